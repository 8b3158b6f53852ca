/* Memory DVR — symbol visibility of the public API (C and C++).
 *
 * libdvr.so and libdvr_mpi.so are compiled with -fvisibility=hidden and
 * -fvisibility-inlines-hidden: only what the public headers mark DVR_EXPORT
 * (the classes, free functions and C functions of the C++ headers, dvr/dvr.h and
 * dvr/dvr_mpi.h) is exported; everything else, the library's internals
 * (namespace dvr::detail) included, stays inside the library.
 *
 * DVR_EXPORT gives a declaration default visibility, both while the library is
 * built and in a program using it; it is the same in both, so a program needs
 * no macro of its own. On a class it covers the vtable and the typeinfo too:
 * dvr::Error thrown inside the library is caught in the program.
 * DVR_NO_EXPORT keeps a declaration hidden (private nested types of exported
 * classes).
 */
#ifndef DVR_EXPORT_H
#define DVR_EXPORT_H

#if defined(__GNUC__) || defined(__clang__)
#define DVR_EXPORT __attribute__((visibility("default")))
#define DVR_NO_EXPORT __attribute__((visibility("hidden")))
#else
#define DVR_EXPORT
#define DVR_NO_EXPORT
#endif

#endif /* DVR_EXPORT_H */
