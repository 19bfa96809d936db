//! One deadline bounds every wait of an exchange: the time left until it,
//! and telling its timeouts from other errors.

use std::time::{Duration, Instant};

use crate::error::Error;

/// The deadline `timeout` from now; a timeout too large to represent means
/// "practically never".
pub(super) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Time left until `deadline`, or `None` once it has passed.
pub(super) fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
}

/// Whether `error` is a timeout: the two sides' timeouts are merged into one
/// that names every missing rank, while any other error stands as it is.
pub(super) fn is_timeout(error: &Error) -> bool {
    matches!(error, Error::Timeout { .. })
}
