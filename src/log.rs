//! Logging through `tracing`, with an NCCL_DEBUG-like switch:
//! `FERROCOMM_DEBUG=warn|info|debug|trace`.
//!
//! Where the events go:
//! - `FERROCOMM_DEBUG` set: to ferrocomm's own stderr writer, at that level,
//!   whatever else the application does with `tracing` (as NCCL_DEBUG prints
//!   regardless of the application's logging);
//! - unset, and the application installed a global `tracing` subscriber: to
//!   that subscriber (target `ferrocomm`), which filters as it likes;
//! - unset, and no subscriber: errors only, to stderr. These are the errors
//!   the caller did not receive as a `Result` (a resource that failed to
//!   release in `Drop`, a cache file that was ignored). Nothing else is
//!   printed by default.
//!
//! ferrocomm never installs a global subscriber, so an engine stays free to
//! install its own at any time.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::OnceLock;

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Dispatch, Event, Level, Metadata, Subscriber};

/// The level `FERROCOMM_DEBUG` asks for, if it is set.
fn requested_level() -> Option<LevelFilter> {
    parse_level(&std::env::var("FERROCOMM_DEBUG").ok()?)
}

/// `FERROCOMM_DEBUG`'s value as a level; `None` for an empty value.
fn parse_level(v: &str) -> Option<LevelFilter> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" => None,
        "off" | "none" | "0" => Some(LevelFilter::OFF),
        "error" => Some(LevelFilter::ERROR),
        "warn" | "warning" => Some(LevelFilter::WARN),
        "info" | "1" => Some(LevelFilter::INFO),
        "debug" => Some(LevelFilter::DEBUG),
        "trace" => Some(LevelFilter::TRACE),
        // An unknown value still asks for logs: give the most useful level.
        _ => Some(LevelFilter::INFO),
    }
}

/// ferrocomm's stderr writer and whether it overrides the application's.
struct Own {
    dispatch: Dispatch,
    forced: bool,
    level: LevelFilter,
}

fn own() -> &'static Own {
    static OWN: OnceLock<Own> = OnceLock::new();
    OWN.get_or_init(|| {
        let requested = requested_level();
        let level = requested.unwrap_or(LevelFilter::ERROR);
        Own {
            dispatch: Dispatch::new(LineWriter {
                level,
                write: |line: &str| {
                    // One write per line, so lines from ranks sharing a
                    // terminal do not interleave.
                    let _ = std::io::stderr().lock().write_all(line.as_bytes());
                },
            }),
            forced: requested.is_some(),
            level,
        }
    })
}

/// Whether an event at `level` would go anywhere: checked before any
/// argument is formatted, so disabled logging costs a comparison.
pub(crate) fn enabled(level: Level) -> bool {
    let own = own();
    if own.forced || !tracing::dispatcher::has_been_set() {
        level <= own.level
    } else {
        level <= LevelFilter::current()
    }
}

/// Run `emit` (a `tracing` event macro) against the right subscriber.
pub(crate) fn emit(emit: impl FnOnce()) {
    let own = own();
    if own.forced || !tracing::dispatcher::has_been_set() {
        tracing::dispatcher::with_default(&own.dispatch, emit);
    } else {
        emit();
    }
}

/// `fc_log!(Level::INFO, "text {}", x)`: an event with target `ferrocomm`.
macro_rules! fc_log {
    ($level:expr, $($arg:tt)+) => {
        if $crate::log::enabled($level) {
            $crate::log::emit(|| ::tracing::event!(target: "ferrocomm", $level, $($arg)+));
        }
    };
}
pub(crate) use fc_log;

/// Writes events as one line each, `ferrocomm <pid> LEVEL message key=value`,
/// through `write` (stderr, or a test's buffer).
struct LineWriter<W> {
    level: LevelFilter,
    write: W,
}

struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value}");
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

impl<W: Fn(&str) + Send + Sync + 'static> Subscriber for LineWriter<W> {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target().starts_with("ferrocomm") && *metadata.level() <= self.level
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.level)
    }

    fn new_span(&self, _span: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _span: &Id, _values: &Record<'_>) {}

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut line = Line(format!(
            "ferrocomm {} {:>5}",
            std::process::id(),
            event.metadata().level()
        ));
        event.record(&mut line);
        line.0.push('\n');
        (self.write)(&line.0);
    }

    fn enter(&self, _span: &Id) {}

    fn exit(&self, _span: &Id) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn levels_parse_like_nccl_debug() {
        assert_eq!(parse_level(""), None);
        assert_eq!(parse_level("WARN"), Some(LevelFilter::WARN));
        assert_eq!(parse_level(" info "), Some(LevelFilter::INFO));
        assert_eq!(parse_level("debug"), Some(LevelFilter::DEBUG));
        assert_eq!(parse_level("trace"), Some(LevelFilter::TRACE));
        assert_eq!(parse_level("off"), Some(LevelFilter::OFF));
        assert_eq!(parse_level("verbose"), Some(LevelFilter::INFO));
    }

    #[test]
    fn lines_carry_level_message_and_fields_and_respect_the_level() {
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let sink = lines.clone();
        let writer = LineWriter {
            level: LevelFilter::INFO,
            write: move |l: &str| sink.lock().unwrap().push(l.to_string()),
        };
        tracing::dispatcher::with_default(&Dispatch::new(writer), || {
            tracing::info!(target: "ferrocomm", world = 4, "communicator ready");
            tracing::debug!(target: "ferrocomm", "filtered out at info");
            tracing::info!(target: "other_crate", "not ours");
        });
        let lines = lines.lock().unwrap();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains(" INFO communicator ready world=4\n"),
            "{:?}",
            lines[0]
        );
        assert!(lines[0].starts_with(&format!("ferrocomm {} ", std::process::id())));
    }
}
