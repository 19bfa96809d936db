//! How the broadcaster waits: spin briefly (back-to-back messages arrive
//! within microseconds), then sleep in short slices (a futex on the ring,
//! `poll` on a socket) so that idle ranks leave the cores to others; every
//! few milliseconds the caller checks that its peers are alive and lets
//! its interrupt hook run (Python's Ctrl-C); past the deadline the wait
//! ends with the caller's error.

use std::time::{Duration, Instant};

use crate::error::Result;

/// Longest single sleep: bounds how late a dead peer or an interrupt is
/// noticed while nothing else wakes the waiter.
pub(super) const SLICE: Duration = Duration::from_millis(10);

/// A caller's hook, run between sleeps; an error ends the wait with it.
pub type Interrupt<'a> = &'a mut dyn FnMut() -> Result<()>;

/// One bounded wait.
pub(super) struct Waiter<'a> {
    started: Instant,
    deadline: Instant,
    spin: Duration,
    last_check: Instant,
    interrupt: Interrupt<'a>,
}

/// What the caller does next.
pub(super) enum Step {
    /// Look at the condition again (after a spin or a sleep).
    Again,
    /// Look at the peers' liveness too, then at the condition.
    Check,
}

impl<'a> Waiter<'a> {
    pub(super) fn new(timeout: Duration, spin: Duration, interrupt: Interrupt<'a>) -> Self {
        let now = Instant::now();
        Waiter {
            started: now,
            // A timeout too large to add means "practically never".
            deadline: now
                .checked_add(timeout)
                .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600)),
            spin,
            last_check: now,
            interrupt,
        }
    }

    pub(super) fn expired(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// Time left until the deadline (zero once past it).
    pub(super) fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Wait a little, the condition having been found false: spin (with
    /// yields, so a peer on the same core runs) during the spin period,
    /// then call `sleep` with the longest sleep allowed now. Runs the
    /// interrupt hook and asks for a liveness check every [`SLICE`].
    pub(super) fn pause(&mut self, sleep: impl FnOnce(Duration)) -> Result<Step> {
        let now = Instant::now();
        if now.duration_since(self.last_check) >= SLICE {
            self.last_check = now;
            (self.interrupt)()?;
            return Ok(Step::Check);
        }
        if now.duration_since(self.started) < self.spin {
            for _ in 0..32 {
                std::hint::spin_loop();
            }
            std::thread::yield_now();
            return Ok(Step::Again);
        }
        let until_check = SLICE.saturating_sub(now.duration_since(self.last_check));
        let nap = until_check.min(self.deadline.saturating_duration_since(now));
        if !nap.is_zero() {
            sleep(nap);
        }
        Ok(Step::Again)
    }
}

/// The interrupt hook of callers that have none.
pub(super) fn never() -> Result<()> {
    Ok(())
}
