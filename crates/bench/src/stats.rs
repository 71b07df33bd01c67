//! The timing and statistics the bench drivers report with: repetitions of
//! a figure and its baseline timed in alternation ([`interleaved`]),
//! medians of repetitions, and a distribution-free 95% confidence interval
//! of a median.
//!
//! Invariant: a median of an even count is the upper one, and of nothing
//! is 0, so a figure is always a value that was measured (or 0).

use std::time::{Duration, Instant};

use anyhow::Result;

/// The median of `v` (the upper one of an even count); 0 when empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// A 95% confidence interval of the median of `v`, distribution-free: the
/// `j`-th smallest and `j`-th largest values, `j` the largest rank with
/// `P(Binomial(n, 1/2) < j) <= 0.025` (the chance that fewer than `j` of
/// `n` draws fall below the true median). `None` for fewer than 6 values,
/// where even the extremes cover less than 95%.
pub fn median_ci95(v: &[f64]) -> Option<[f64; 2]> {
    let n = v.len();
    // P(X < j) for X ~ Binomial(n, 1/2), summed term by term in f64
    // (exact enough for the repetition counts a bench runs).
    let mut below = 0.0f64;
    let mut term = 0.5f64.powi(n as i32);
    let mut j = 0;
    for i in 0..n {
        if below + term > 0.025 {
            break;
        }
        below += term;
        j = i + 1;
        term *= (n - i) as f64 / (i + 1) as f64;
    }
    if j == 0 {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    Some([s[j - 1], s[n - j]])
}

/// Seconds, never zero (a rate over a zero duration would be infinite).
pub fn secs(d: Duration) -> f64 {
    d.as_secs_f64().max(1e-9)
}

/// The median of `v` (the upper one of an even count); zero when empty.
pub fn median_dur(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// One step of a workload, timed or not.
pub type Step<'a, W> = &'a dyn Fn(&mut W) -> Result<()>;

/// An untimed step that does nothing.
pub fn nothing<W>(_: &mut W) -> Result<()> {
    Ok(())
}

/// A step that cannot fail, as a [`Step`].
pub fn infallible<W>(f: fn(&mut W)) -> impl Fn(&mut W) -> Result<()> {
    move |w| {
        f(w);
        Ok(())
    }
}

/// Median times of `reps` repetitions (at least one) of: `prepare`
/// (untimed), then each of `steps` in turn, timed; so a figure and its
/// baseline alternate.
pub fn interleaved<W>(
    reps: usize,
    w: &mut W,
    prepare: Step<'_, W>,
    steps: &[Step<'_, W>],
) -> Result<Vec<Duration>> {
    let mut times = vec![Vec::with_capacity(reps); steps.len()];
    for _ in 0..reps.max(1) {
        prepare(w)?;
        for (f, t) in steps.iter().zip(&mut times) {
            let t0 = Instant::now();
            f(w)?;
            t.push(t0.elapsed());
        }
    }
    Ok(times.into_iter().map(median_dur).collect())
}

#[cfg(test)]
mod tests {
    use super::median_ci95;

    #[test]
    fn the_median_interval_takes_the_binomial_ranks() {
        // n = 10: P(X <= 1) = 11/1024 <= 0.025 < P(X <= 2) = 56/1024, so the
        // 2nd smallest and the 2nd largest.
        let v = [7.0, 3.0, 10.0, 1.0, 5.0, 9.0, 2.0, 8.0, 6.0, 4.0];
        assert_eq!(median_ci95(&v), Some([2.0, 9.0]));
        // n = 6: only the extremes (2/64 <= 0.025 fails, 1/64 holds).
        let v = [6.0, 1.0, 5.0, 2.0, 4.0, 3.0];
        assert_eq!(median_ci95(&v), Some([1.0, 6.0]));
        // n = 40: P(X <= 13) = 0.0192, P(X <= 14) = 0.0403: ranks 14 and 27.
        let v: Vec<f64> = (1..=40).rev().map(f64::from).collect();
        assert_eq!(median_ci95(&v), Some([14.0, 27.0]));
        // Under 6 values even the extremes cover less than 95%.
        assert_eq!(median_ci95(&[1.0, 2.0, 3.0, 4.0, 5.0]), None);
        assert_eq!(median_ci95(&[]), None);
    }
}
