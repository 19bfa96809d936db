//! Blocking waits on 32-bit words in shared memory (Linux futexes), so host
//! ranks that outnumber the cores sleep in the kernel instead of spinning.
//! The words may live in memory shared between processes (memfd mappings,
//! possibly at different addresses): the futexes are not process-private.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleep while `word` holds `expected`, for at most `timeout`. Returns early
/// on a wake, a change of the word, or a signal; callers re-check.
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 for the duration of the call;
    // FUTEX_WAIT only reads it, and `ts` outlives the call. Errors (EAGAIN:
    // the value already changed, ETIMEDOUT, EINTR) all mean "re-check".
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wake every waiter on `word` (after storing to it).
pub(crate) fn wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned u32; FUTEX_WAKE does not access it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}
