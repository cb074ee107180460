//! Component health for `/health`: backends post what an operator should see there (the I/O
//! engine a tier chose, a directory taken out of service) and `/health` renders it.
//!
//! A degraded component does not make the server unhealthy: it keeps serving (the probe
//! answers 200), and the body says what is degraded. With no report, or only `Ok` reports,
//! the body is `ok`, PegaFlow's answer.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// The state of one component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthState {
    /// Working as configured.
    Ok,
    /// Serving with less than it was configured with (a failed directory dropped from
    /// service, a fallback engine): the server keeps serving.
    Degraded,
}

#[derive(Debug, Clone)]
struct Report {
    state: HealthState,
    detail: String,
}

/// Reports by component name (`ssd /nvme0/pegaflow`), shared by every clone.
#[derive(Debug, Clone, Default)]
pub struct HealthBoard {
    reports: Arc<Mutex<BTreeMap<String, Report>>>,
}

impl HealthBoard {
    /// Sets (replaces) the report of `component`; `detail` is one line for operators.
    pub fn report(&self, component: &str, state: HealthState, detail: impl Into<String>) {
        self.reports.lock().insert(
            component.to_owned(),
            Report {
                state,
                detail: detail.into(),
            },
        );
    }

    /// Whether any component is degraded.
    pub fn degraded(&self) -> bool {
        self.reports
            .lock()
            .values()
            .any(|r| r.state == HealthState::Degraded)
    }

    /// The `/health` body: `ok` (or `degraded`) on the first line, then one
    /// `component: state; detail` line per report, in name order. Just `ok` without reports.
    pub fn render(&self) -> String {
        let reports = self.reports.lock();
        let degraded = reports.values().any(|r| r.state == HealthState::Degraded);
        let mut out = String::from(if degraded { "degraded" } else { "ok" });
        for (name, r) in reports.iter() {
            let state = match r.state {
                HealthState::Ok => "ok",
                HealthState::Degraded => "degraded",
            };
            out.push_str(&format!("\n{name}: {state}; {}", r.detail));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_board_says_ok_and_a_degraded_component_says_so() {
        let b = HealthBoard::default();
        assert_eq!(b.render(), "ok");
        b.report("ssd /a", HealthState::Ok, "io=posix");
        assert_eq!(b.render(), "ok\nssd /a: ok; io=posix");
        assert!(!b.degraded());
        b.report("ssd /b", HealthState::Degraded, "8 write errors in a row");
        assert!(b.degraded());
        assert_eq!(
            b.render(),
            "degraded\nssd /a: ok; io=posix\nssd /b: degraded; 8 write errors in a row"
        );
        b.report("ssd /b", HealthState::Ok, "back");
        assert!(!b.degraded());
    }
}
