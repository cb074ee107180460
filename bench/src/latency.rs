//! Latency summaries: count, mean and nearest-rank percentiles of a list of samples.

use serde::Serialize;

/// A summary of latency samples, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LatencyStats {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean_us: f64,
    /// Median (nearest rank).
    pub p50_us: f64,
    /// 99th percentile (nearest rank).
    pub p99_us: f64,
    /// Largest sample.
    pub max_us: f64,
    /// Sum of all samples, in seconds.
    pub total_s: f64,
}

impl LatencyStats {
    /// Summarizes `samples_us` (sorted in place).
    pub fn of(samples_us: &mut [f64]) -> Self {
        if samples_us.is_empty() {
            return Self::default();
        }
        samples_us.sort_by(|a, b| a.total_cmp(b));
        let n = samples_us.len();
        let rank = |q: f64| samples_us[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        let sum: f64 = samples_us.iter().sum();
        Self {
            count: n as u64,
            mean_us: sum / n as f64,
            p50_us: rank(0.50),
            p99_us: rank(0.99),
            max_us: samples_us[n - 1],
            total_s: sum / 1e6,
        }
    }
}

/// A duration in microseconds as a short human string (`850 µs`, `12.3 ms`).
pub fn human_us(us: f64) -> String {
    if us >= 1e6 {
        format!("{:.2} s", us / 1e6)
    } else if us >= 1e3 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{us:.0} µs")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = LatencyStats::of(&mut v);
        assert_eq!(s.count, 100);
        assert_eq!(s.p50_us, 50.0);
        assert_eq!(s.p99_us, 99.0);
        assert_eq!(s.max_us, 100.0);
        assert_eq!(s.mean_us, 50.5);
        assert_eq!(LatencyStats::of(&mut []), LatencyStats::default());
        let mut one = [7.0];
        assert_eq!(LatencyStats::of(&mut one).p99_us, 7.0);
    }
}
