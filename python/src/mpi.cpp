// memdvr._mpi — pybind11 bindings of dvr::mpi::Session (dvr/mpi.hpp):
// coordinated snapshots across the ranks of an MPI communicator. Use it
// through memdvr.mpi (python/memdvr/mpi.py), which takes mpi4py communicators
// and hands them over as Fortran handles (comm.py2f(), MPI_Comm_f2c here).
//
// memdvr._core is imported first: this module uses its dvr::Store class and
// its exception translator (dvr::Error -> memdvr.DvrError subclasses), which
// pybind11 shares between modules built with the same pybind11.
//
// The rank's local dvr::Session belongs to the dvr::mpi::Session, while a
// memdvr._core.Session owns its dvr::Session, so the local session cannot be
// one. LocalSession offers the methods of memdvr._core.Session that
// memdvr.Session calls, over the borrowed session, and memdvr.mpi wraps it in
// a memdvr.Session (Session._wrap). Ownership, as in core.cpp:
//  * The tracked buffers and objects and the tokens of alloc()ed regions live
//    in the MpiSession, declared before the dvr::mpi::Session so that they are
//    released after it.
//  * A LocalSession keeps its MpiSession alive; each memoryview onto an
//    SDK-owned region keeps its LocalSession alive, and untrack()/close()
//    refuse while such a view is still referenced.
//  * The GIL is released around the collective calls (the constructor,
//    snapshot, restore_latest) and the local snapshot, restore and latest.
#include <mpi.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dvr/dvr.hpp>
#include <dvr/mpi.hpp>

#include "regions.hpp"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

py::dict global_info_dict(const dvr::mpi::GlobalInfo& g) {
  py::dict d;
  d["name"] = g.name;
  d["seq"] = g.seq;
  d["stored_bytes"] = g.stored_bytes;
  d["partner_bytes"] = g.partner_bytes;
  d["seconds"] = g.seconds;
  return d;
}

// ---------------------------------------------------------------- MpiSession

struct MpiSession {
  RegionBuffers regions;  // before `mpi`: released after it (see the top of the file)
  std::unique_ptr<dvr::mpi::Session> mpi;

  dvr::mpi::Session& get() {
    if (!mpi) invalid("memdvr.mpi: the session is closed");
    return *mpi;
  }
  dvr::Session& local() { return get().local(); }
};

// The rank's local session: a view of its MpiSession.
struct LocalSession {
  py::object owner;  // the MpiSession
  MpiSession* s = nullptr;
};

void local_untrack(LocalSession& l, const std::string& name) {
  MpiSession& s = *l.s;
  s.local().region(name);  // not_found first
  s.regions.check_no_views(s.local().name(), name);
  s.local().untrack(name);
  s.regions.forget(name);
}

}  // namespace

PYBIND11_MODULE(_mpi, m) {
  m.doc() = "memdvr._mpi: bindings of dvr::mpi::Session (use memdvr.mpi)";
  // dvr::Store and the dvr::Error translator are memdvr._core's.
  py::module_::import("memdvr._core");

  m.def(
      "mpi_library_version",
      [] {
        char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
        int len = 0;
        MPI_Get_library_version(text, &len);
        return std::string(text, static_cast<std::size_t>(len));
      },
      "MPI_Get_library_version() of the MPI library this module is linked to.");

  register_memory_owner(m);

  // ---- LocalSession: what memdvr.Session calls on memdvr._core.Session.
  py::class_<LocalSession>(m, "LocalSession",
                           "The rank's own session of a memdvr._mpi.Session (the methods of "
                           "memdvr._core.Session); it closes with the MPI session.")
      .def_property_readonly("name", [](LocalSession& l) { return l.s->local().name(); })
      .def_property_readonly("store", [](LocalSession& l) { return l.s->local().store(); })
      .def_property_readonly("head", [](LocalSession& l) { return l.s->local().head(); })
      .def_property_readonly("closed", [](LocalSession& l) { return !l.s->mpi; })
      .def(
          "track", [](LocalSession& l, const std::string& name, py::object obj) { l.s->regions.track(l.s->local(), name, std::move(obj)); },
          py::arg("name"), py::arg("buffer"), "Tracks a writable C-contiguous buffer in place (zero-copy); holds a reference to it.")
      .def(
          "alloc",
          [](py::object self, const std::string& name, std::size_t size) {
            MpiSession& s = *self.cast<LocalSession&>().s;
            return s.regions.alloc(self, s.local(), name, size);
          },
          py::arg("name"), py::arg("size"), "Allocates an SDK-owned, zero-filled region; returns a writable memoryview onto it.")
      .def("untrack", &local_untrack, py::arg("name"))
      .def(
          "buffer",
          [](py::object self, const std::string& name) {
            MpiSession& s = *self.cast<LocalSession&>().s;
            return s.regions.buffer(self, s.local(), name);
          },
          py::arg("name"), "The tracked object, or a new memoryview onto an SDK-owned region.")
      .def("regions", [](LocalSession& l) { return regions_list(l.s->local().regions()); })
      .def(
          "snapshot",
          [](LocalSession& l, const std::string& name, const std::string& label, bool replace) {
            dvr::Session& session = l.s->local();
            dvr::SnapshotInfo info;
            {
              py::gil_scoped_release nogil;
              info = session.snapshot(name, {.label = label, .replace = replace});
            }
            return snapshot_info_dict(info);
          },
          py::arg("name"), py::arg("label") = "", py::arg("replace") = false, "A snapshot of this rank's regions alone (not a global snapshot).")
      .def(
          "restore",
          [](LocalSession& l, const std::string& name) {
            dvr::Session& session = l.s->local();
            py::gil_scoped_release nogil;
            session.restore(name);
          },
          py::arg("name"))
      .def("list",
           [](LocalSession& l) {
             py::list out;
             for (const auto& i : l.s->local().list())
               out.append(snapshot_info_dict(i));
             return out;
           })
      .def("latest",
           [](LocalSession& l) -> py::object {
             dvr::Session& session = l.s->local();
             std::optional<dvr::SnapshotInfo> i;
             {
               py::gil_scoped_release nogil;
               i = session.latest();
             }
             if (!i) return py::none();
             return snapshot_info_dict(*i);
           })
      .def(
          "clone",
          [](LocalSession& l, const std::string& name, bool verify) {
            // dvr::Session::clone is store().open_snapshot(name(), ...): the
            // memdvr._core.Clone comes from memdvr._core.Store.open_snapshot.
            dvr::Session& session = l.s->local();
            return py::cast(session.store()).attr("open_snapshot")(session.name(), name, verify);
          },
          py::arg("name"), py::arg("verify") = true)
      .def(
          "tracking", [](LocalSession& l, const std::string& region) { return dvr::tracking_name(l.s->local().tracking(region)); }, py::arg("region"))
      .def("tracking_note", [](LocalSession& l) { return l.s->local().tracking_note(); })
      .def(
          "close",
          [](LocalSession& l) {
            if (!l.s->mpi) return;
            invalid("the local session of memdvr.mpi.Session '" + l.s->local().name() + "' closes with it: call close() on the memdvr.mpi.Session");
          },
          "Refused while the MPI session is open (close that instead); nothing once it is closed.");

  // ---- Session
  py::class_<MpiSession>(m, "Session",
                         "dvr::mpi::Session: coordinated snapshots across the ranks of a "
                         "communicator (use memdvr.mpi.Session).")
      .def(py::init([](const dvr::Store& store, const std::string& name, long long comm_f, int partner_offset, bool partner_copies, std::size_t keep,
                       int level) {
             int initialized = 0, finalized = 0;
             MPI_Initialized(&initialized);
             MPI_Finalized(&finalized);
             if (!initialized || finalized)
               invalid("memdvr.mpi: MPI is " + std::string(finalized ? "finalized" : "not initialized") +
                       " (import mpi4py.MPI first, and open sessions before MPI.Finalize())");
             MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(comm_f));
             if (comm == MPI_COMM_NULL) invalid("memdvr.mpi: the communicator is MPI_COMM_NULL");
             dvr::mpi::Options o;
             o.partner_offset = partner_offset;
             o.partner_copies = partner_copies;
             o.keep = keep;
             o.level = level;
             auto s = std::make_unique<MpiSession>();
             {
               py::gil_scoped_release nogil;
               s->mpi = std::make_unique<dvr::mpi::Session>(store, name, comm, o);
             }
             return s;
           }),
           py::arg("store"), py::arg("name"), py::arg("comm"), py::arg("partner_offset") = 0, py::arg("partner_copies") = true, py::arg("keep") = 3,
           py::arg("level") = 1, "Collective over the communicator whose Fortran handle is `comm` (mpi4py: comm.py2f()).")
      .def(
          "local",
          [](py::object self) {
            auto l = std::make_unique<LocalSession>();
            l->s = &self.cast<MpiSession&>();
            l->s->get();  // refused once closed
            l->owner = std::move(self);
            return l;
          },
          "The rank's own session (a LocalSession; it keeps this session alive).")
      .def_property_readonly("rank", [](MpiSession& s) { return s.get().rank(); })
      .def_property_readonly("size", [](MpiSession& s) { return s.get().size(); })
      .def_property_readonly("partner", [](MpiSession& s) { return s.get().partner(); })
      .def_property_readonly("closed", [](MpiSession& s) { return !s.mpi; })
      .def(
          "snapshot",
          [](MpiSession& s, const std::string& name) {
            dvr::mpi::Session& mpi = s.get();
            dvr::mpi::GlobalInfo info;
            {
              py::gil_scoped_release nogil;
              info = mpi.snapshot(name);
            }
            return global_info_dict(info);
          },
          py::arg("name"), "Collective: a global snapshot (dict: name, seq, stored_bytes, partner_bytes, seconds).")
      .def(
          "restore_latest",
          [](MpiSession& s) {
            dvr::mpi::Session& mpi = s.get();
            std::optional<std::string> name;
            {
              py::gil_scoped_release nogil;
              name = mpi.restore_latest();
            }
            return name;
          },
          "Collective: restores the newest global snapshot every rank can restore; its name, or None.")
      .def(
          "committed",
          [](MpiSession& s) {
            dvr::mpi::Session& mpi = s.get();
            std::vector<dvr::mpi::GlobalInfo> infos;
            {
              py::gil_scoped_release nogil;
              infos = mpi.committed();
            }
            py::list out;
            for (const auto& g : infos)
              out.append(global_info_dict(g));
            return out;
          },
          "The global snapshots committed, oldest first, as this rank's records say.")
      .def(
          "close",
          [](MpiSession& s) {
            if (!s.mpi) return;
            s.regions.check_no_views(s.local().name());
            s.mpi.reset();
            s.regions.clear();
          },
          "Ends the session: forgets every local region and releases the tracked buffers.");
}
