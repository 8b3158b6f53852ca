! Memory DVR from Fortran: a time-step loop that checkpoints and restarts.
!
! The same program as examples/c/checkpoint.c: a 1-D heat equation on N
! doubles (fixed ends, explicit Euler) runs for STEPS steps and takes a snapshot
! "step-NNNNNN" every K steps; started again on the same store it restarts from
! the newest intact snapshot (dvr_latest + dvr_restore). Here both regions are
! Fortran arrays tracked in place (dvr_track with c_loc).
!
!   dvr-example-fortran STORE_DIR STEPS [--every K] [--crash-at STEP]
!
! --crash-at STEP ends the process abruptly (_exit(3), no cleanup) right after
! computing step STEP. The last line is "checksum: <hex>", an FNV-1a (32-bit)
! hash of the final array's bytes.
program heat
  use, intrinsic :: iso_c_binding
  use, intrinsic :: iso_fortran_env, only: output_unit, error_unit, int8, int64
  use dvr
  implicit none

  interface
    subroutine c_exit(status) bind(C, name="_exit")
      import :: c_int
      integer(c_int), value :: status
    end subroutine c_exit
  end interface

  integer, parameter :: n = 100000
  real(c_double), parameter :: r = 0.25_c_double  ! alpha * dt / dx^2, stable for r <= 0.5
  real(c_double), allocatable, target :: u(:)
  real(c_double), allocatable :: next(:)
  integer(c_int64_t), target :: step(1)           ! steps completed: a region too
  integer(int64) :: steps, every, crash_at
  type(c_ptr) :: store, session
  integer(c_int) :: st
  character(len=DVR_NAME_MAX + 1) :: latest
  character(len=32) :: name
  character(len=64) :: label
  character(len=4096) :: store_dir
  integer :: i

  call parse_args()
  allocate(u(n), next(n))
  step = 0

  st = dvr_store_open(c_str(store_dir), store)
  call check(st, "dvr_store_open")
  st = dvr_session_open(store, c_str("heat"), session)
  call check(st, "dvr_session_open")
  st = dvr_track(session, c_str("u"), c_loc(u), int(c_sizeof(u(1)) * n, c_size_t))
  call check(st, "dvr_track u")
  st = dvr_track(session, c_str("progress"), c_loc(step), int(c_sizeof(step), c_size_t))
  call check(st, "dvr_track progress")

  st = dvr_latest(store, c_str("heat"), latest, int(len(latest), c_size_t))
  if (st == DVR_OK) then
    st = dvr_restore(session, latest)
    call check(st, "dvr_restore")
    print '(a, a, a, i0, a)', "restarted from ", dvr_buffer_text(latest), " (step ", step(1), ")"
  else if (st == DVR_E_NOT_FOUND) then
    do i = 1, n
      u(i) = merge(100.0_c_double, 0.0_c_double, i - 1 > n / 4 .and. i - 1 < n / 2)
    end do
    print '(a)', "starting fresh"
  else
    call check(st, "dvr_latest")
  end if

  do while (step(1) < steps)
    next(2:n - 1) = u(2:n - 1) + r * (u(1:n - 2) - 2.0_c_double * u(2:n - 1) + u(3:n))
    u(2:n - 1) = next(2:n - 1)
    step(1) = step(1) + 1
    if (step(1) == crash_at) then
      print '(a, i0)', "crashing at step ", step(1)
      flush(output_unit)
      call c_exit(3_c_int)
    end if
    if (mod(step(1), every) == 0) then
      write(name, '(a, i6.6)') "step-", step(1)
      write(label, '(a, i0, a)') "heat equation after ", step(1), " steps"
      st = dvr_snapshot(session, c_str(name), c_str(label))
      call check(st, "dvr_snapshot")
    end if
  end do

  print '(a, i0, a, es25.17)', "step ", step(1), ", u(N/2+1) = ", u(n / 2 + 1)
  print '(a, z8.8)', "checksum: ", fnv1a32(u)
  call dvr_session_close(session)  ! forgets the regions: u may go now
  call dvr_store_close(store)
  deallocate(u, next)

contains

  subroutine check(status, what)
    integer(c_int), intent(in) :: status
    character(len=*), intent(in) :: what
    if (status /= DVR_OK) then
      write(error_unit, '(a, a, a, i0, a, a)') "dvr-example-fortran: ", what, " failed (status ", status, "): ", &
        dvr_errmsg()
      error stop 1
    end if
  end subroutine check

  subroutine parse_args()
    character(len=256) :: arg
    integer :: k, nargs
    nargs = command_argument_count()
    if (nargs < 2) then
      write(error_unit, '(a)') "usage: dvr-example-fortran STORE_DIR STEPS [--every K] [--crash-at STEP]"
      stop 2  ! a usage error: no backtrace
    end if
    call get_command_argument(1, store_dir)
    call get_command_argument(2, arg)
    steps = parse_count(arg, "STEPS")
    every = 100
    crash_at = -1
    k = 3
    do while (k <= nargs)
      call get_command_argument(k, arg)
      if ((arg == "--every" .or. arg == "--crash-at") .and. k < nargs) then
        call get_command_argument(k + 1, name)
        if (arg == "--every") then
          every = parse_count(name, "--every")
        else
          crash_at = parse_count(name, "--crash-at")
        end if
        k = k + 2
      else
        write(error_unit, '(a, a, a)') "dvr-example-fortran: unknown argument '", trim(arg), "'"
        stop 2
      end if
    end do
    if (every == 0) every = 1
  end subroutine parse_args

  integer(int64) function parse_count(text, what)
    character(len=*), intent(in) :: text, what
    integer :: ios
    read(text, *, iostat=ios) parse_count
    if (ios /= 0 .or. parse_count < 0 .or. len_trim(text) == 0) then
      write(error_unit, '(a, a, a, a, a)') "dvr-example-fortran: ", what, " must be a non-negative integer, not '", &
        trim(text), "'"
      stop 2
    end if
  end function parse_count

  ! FNV-1a over the array's bytes, 32-bit (computed in 64-bit integers so
  ! nothing overflows).
  integer(int64) function fnv1a32(a)
    real(c_double), intent(in) :: a(:)
    integer(int8), allocatable :: bytes(:)
    integer(int64), parameter :: mask = int(z'FFFFFFFF', int64)
    integer :: j
    allocate(bytes(size(a) * (storage_size(a) / 8)))
    bytes(:) = transfer(a, bytes, size(bytes))
    fnv1a32 = int(z'811C9DC5', int64)
    do j = 1, size(bytes)
      fnv1a32 = iand(ieor(fnv1a32, iand(int(bytes(j), int64), 255_int64)) * 16777619_int64, mask)
    end do
  end function fnv1a32

end program heat
