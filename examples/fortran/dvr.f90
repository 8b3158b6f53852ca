! Memory DVR from Fortran: bind(C) interfaces to the C API (dvr/dvr.h).
!
! Every interface matches a declaration in dvr.h; see that header (or
! docs/c_api.md) for what each call does and which status it returns. Strings
! go to C NUL-terminated: pass trim(name)//c_null_char, or c_str(name). Buffers
! go as type(c_ptr) from c_loc of a target array. Copy this module into your
! code and link with -ldvr.
module dvr
  use, intrinsic :: iso_c_binding, only: c_ptr, c_char, c_int, c_int64_t, c_size_t, c_null_char, &
                                         c_f_pointer, c_associated
  implicit none
  private :: c_ptr, c_char, c_int, c_int64_t, c_size_t, c_null_char, c_f_pointer, c_associated

  ! dvr_status
  enum, bind(c)
    enumerator :: DVR_OK = 0, DVR_E_NOT_FOUND, DVR_E_ALREADY_EXISTS, DVR_E_CORRUPT, DVR_E_NO_SPACE, &
                  DVR_E_INVALID_ARGUMENT, DVR_E_IO, DVR_E_UNSUPPORTED, DVR_E_PERMISSION, DVR_E_NOMEM, &
                  DVR_E_INTERNAL
  end enum

  ! The longest name; a buffer of DVR_NAME_MAX + 1 characters holds any name.
  integer, parameter :: DVR_NAME_MAX = 128

  ! One entry of dvr_list (the strings are C pointers: see dvr_string).
  ! logical_bytes and stored_bytes are uint64_t in C.
  type, bind(c) :: dvr_snapshot_info
    type(c_ptr) :: name, parent, label, damage
    integer(c_int64_t) :: time_ns
    integer(c_int64_t) :: logical_bytes, stored_bytes
    integer(c_int) :: damaged
  end type dvr_snapshot_info

  interface
    function dvr_errmsg_c() bind(C, name="dvr_errmsg") result(msg)
      import :: c_ptr
      type(c_ptr) :: msg
    end function dvr_errmsg_c

    function dvr_version_c() bind(C, name="dvr_version") result(version)
      import :: c_ptr
      type(c_ptr) :: version
    end function dvr_version_c

    integer(c_int) function dvr_store_open(path, store) bind(C, name="dvr_store_open")
      import :: c_char, c_ptr, c_int
      character(kind=c_char), dimension(*), intent(in) :: path
      type(c_ptr), intent(out) :: store
    end function dvr_store_open

    subroutine dvr_store_close(store) bind(C, name="dvr_store_close")
      import :: c_ptr
      type(c_ptr), value :: store
    end subroutine dvr_store_close

    integer(c_int) function dvr_store_path(store, path) bind(C, name="dvr_store_path")
      import :: c_ptr, c_int
      type(c_ptr), value :: store
      type(c_ptr), intent(out) :: path
    end function dvr_store_path

    integer(c_int) function dvr_list(store, session, list, count) bind(C, name="dvr_list")
      import :: c_ptr, c_char, c_size_t, c_int
      type(c_ptr), value :: store
      character(kind=c_char), dimension(*), intent(in) :: session
      type(c_ptr), intent(out) :: list
      integer(c_size_t), intent(out) :: count
    end function dvr_list

    subroutine dvr_list_free(list) bind(C, name="dvr_list_free")
      import :: c_ptr
      type(c_ptr), value :: list
    end subroutine dvr_list_free

    integer(c_int) function dvr_latest(store, session, name_buf, buf_size) bind(C, name="dvr_latest")
      import :: c_ptr, c_char, c_size_t, c_int
      type(c_ptr), value :: store
      character(kind=c_char), dimension(*), intent(in) :: session
      character(kind=c_char), dimension(*), intent(inout) :: name_buf
      integer(c_size_t), value :: buf_size
    end function dvr_latest

    integer(c_int) function dvr_remove(store, session, snapshot) bind(C, name="dvr_remove")
      import :: c_ptr, c_char, c_int
      type(c_ptr), value :: store
      character(kind=c_char), dimension(*), intent(in) :: session, snapshot
    end function dvr_remove

    integer(c_int) function dvr_session_open(store, name, session) bind(C, name="dvr_session_open")
      import :: c_ptr, c_char, c_int
      type(c_ptr), value :: store
      character(kind=c_char), dimension(*), intent(in) :: name
      type(c_ptr), intent(out) :: session
    end function dvr_session_open

    subroutine dvr_session_close(session) bind(C, name="dvr_session_close")
      import :: c_ptr
      type(c_ptr), value :: session
    end subroutine dvr_session_close

    integer(c_int) function dvr_track(session, region, data, size) bind(C, name="dvr_track")
      import :: c_ptr, c_char, c_size_t, c_int
      type(c_ptr), value :: session
      character(kind=c_char), dimension(*), intent(in) :: region
      type(c_ptr), value :: data
      integer(c_size_t), value :: size
    end function dvr_track

    integer(c_int) function dvr_alloc(session, region, size, data) bind(C, name="dvr_alloc")
      import :: c_ptr, c_char, c_size_t, c_int
      type(c_ptr), value :: session
      character(kind=c_char), dimension(*), intent(in) :: region
      integer(c_size_t), value :: size
      type(c_ptr), intent(out) :: data
    end function dvr_alloc

    integer(c_int) function dvr_untrack(session, region) bind(C, name="dvr_untrack")
      import :: c_ptr, c_char, c_int
      type(c_ptr), value :: session
      character(kind=c_char), dimension(*), intent(in) :: region
    end function dvr_untrack

    ! The label may be NULL in C; from Fortran pass "" // c_null_char for none.
    integer(c_int) function dvr_snapshot(session, name, label) bind(C, name="dvr_snapshot")
      import :: c_ptr, c_char, c_int
      type(c_ptr), value :: session
      character(kind=c_char), dimension(*), intent(in) :: name, label
    end function dvr_snapshot

    integer(c_int) function dvr_restore(session, name) bind(C, name="dvr_restore")
      import :: c_ptr, c_char, c_int
      type(c_ptr), value :: session
      character(kind=c_char), dimension(*), intent(in) :: name
    end function dvr_restore

    function c_strlen(s) bind(C, name="strlen") result(n)
      import :: c_ptr, c_size_t
      type(c_ptr), value :: s
      integer(c_size_t) :: n
    end function c_strlen
  end interface
  private :: dvr_errmsg_c, dvr_version_c, c_strlen

contains

  ! A Fortran string as a NUL-terminated C string (trailing blanks dropped).
  function c_str(s) result(c)
    character(len=*), intent(in) :: s
    character(kind=c_char, len=len_trim(s) + 1) :: c
    c = trim(s) // c_null_char
  end function c_str

  ! A C string (a pointer from the C API) as a Fortran string.
  function dvr_string(p) result(s)
    type(c_ptr), intent(in) :: p
    character(len=:), allocatable :: s
    character(kind=c_char), pointer :: chars(:)
    integer :: i, n
    if (.not. c_associated(p)) then
      s = ""
      return
    end if
    n = int(c_strlen(p))
    call c_f_pointer(p, chars, [n])
    allocate(character(len=n) :: s)
    do i = 1, n
      s(i:i) = chars(i)
    end do
  end function dvr_string

  ! The text of a NUL-terminated buffer (as filled by dvr_latest).
  function dvr_buffer_text(buf) result(s)
    character(len=*), intent(in) :: buf
    character(len=:), allocatable :: s
    integer :: nul
    nul = index(buf, c_null_char)
    if (nul == 0) nul = len(buf) + 1
    s = buf(1:nul - 1)
  end function dvr_buffer_text

  ! The calling thread's last error message (dvr_errmsg).
  function dvr_errmsg() result(s)
    character(len=:), allocatable :: s
    s = dvr_string(dvr_errmsg_c())
  end function dvr_errmsg

  ! The library version, "MAJOR.MINOR.PATCH" (dvr_version).
  function dvr_version() result(s)
    character(len=:), allocatable :: s
    s = dvr_string(dvr_version_c())
  end function dvr_version

end module dvr
