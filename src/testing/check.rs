//! The checks the heap and EP suites record into a [`SuiteReport`]: one
//! line per failure, every check counted.

use super::conformance::SuiteReport;
use crate::error::{Error, Result};

#[derive(Default)]
pub(crate) struct Checker {
    pub(crate) report: SuiteReport,
}

impl Checker {
    pub(crate) fn check(&mut self, case: &str, ok: bool, detail: impl FnOnce() -> String) {
        self.report.collectives += 1;
        if !ok {
            self.report.failures.push(format!("{case}: {}", detail()));
        }
    }

    /// Equal lengths and elements; the first difference is reported.
    fn check_slice<T: PartialEq>(&mut self, case: &str, got: &[T], want: &[T], show: impl Fn(usize) -> String) {
        self.report.elements_checked += want.len();
        let bad = got.iter().zip(want).position(|(g, w)| g != w);
        self.check(case, bad.is_none() && got.len() == want.len(), || match bad {
            Some(i) => show(i),
            None => format!("{} elements, want {}", got.len(), want.len()),
        });
    }

    pub(crate) fn check_values(&mut self, case: &str, got: &[i32], want: &[i32]) {
        self.check_slice(case, got, want, |i| {
            format!("element {i}: got {} want {}", got[i], want[i])
        });
    }

    pub(crate) fn check_bytes(&mut self, case: &str, got: &[u8], want: &[u8]) {
        self.check_slice(case, got, want, |i| {
            format!("byte {i}: got {:#04x} want {:#04x}", got[i], want[i])
        });
    }

    /// Any error whose message mentions `needle`.
    pub(crate) fn check_err<T>(&mut self, case: &str, r: Result<T>, needle: &str) {
        let ok = matches!(&r, Err(e) if e.to_string().contains(needle));
        self.check(case, ok, || match r {
            Ok(_) => "succeeded, want an error".into(),
            Err(e) => format!("error {e:?} does not mention {needle:?}"),
        });
    }

    /// An [`Error::InvalidArgument`] mentioning `needle`.
    pub(crate) fn check_invalid<T>(&mut self, case: &str, r: Result<T>, needle: &str) {
        let ok = matches!(&r, Err(Error::InvalidArgument(m)) if m.contains(needle));
        self.check(case, ok, || match r {
            Ok(_) => "succeeded, want an error".into(),
            Err(e) => format!("error {e:?} is not an InvalidArgument mentioning {needle:?}"),
        });
    }
}
