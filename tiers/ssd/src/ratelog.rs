//! Rate limits for log lines that an I/O failure or a damaged record can repeat thousands of
//! times a second: at most one line per interval, carrying how many were held back since.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// At most one line per `every`.
#[derive(Debug)]
pub(crate) struct LogLimit {
    every: Duration,
    /// When the last line was let through, and events held back since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimit {
    /// A limit of one line per `every`.
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// Records one event: `Some(held back since the last line)` when a line may be logged
    /// for it now, `None` when it is held back.
    pub(crate) fn allow(&self) -> Option<u64> {
        let now = Instant::now();
        let mut s = self.state.lock();
        if s.0.is_none_or(|t| now.duration_since(t) >= self.every) {
            let held = s.1;
            *s = (Some(now), 0);
            Some(held)
        } else {
            s.1 += 1;
            None
        }
    }
}

/// The interval of the SSD tier's repeated WARN lines.
pub(crate) const EVERY: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_counting_what_was_held_back() {
        let l = LogLimit::new(Duration::from_millis(200));
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), None);
        assert_eq!(l.allow(), None);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(l.allow(), Some(2));
        assert_eq!(l.allow(), None);
    }
}
