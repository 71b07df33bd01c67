//! The one Zipf sampler of the workspace's synthetic workloads: the
//! command line's synthetic tokens (`run`, `bench offload`) and the table
//! benches' id streams (`metrale-bench`) draw ranks from it. It is built
//! without any feature because `metrale-ple run`, in every release binary,
//! needs it; it lives here beside [`crate::splitmix`], the lowest crate
//! both the command line and the benches reach.
//!
//! Ranks are drawn by inverting the cumulative distribution, so a draw is
//! a pure function of one uniform number: each caller keeps its own
//! generator and the streams it gives stay repeatable.
//!
//! Invariant: rank `r` (0-based) has probability proportional to
//! `(r + 1)^-s`; every `u` in `[0, 1)` maps to a rank below `len()`.

/// Zipf(`s`) over `n` ranks by inverse CDF.
#[derive(Clone, Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// Zipf(`s`) over ranks `0..n` (`n` of 0 counts as 1).
    pub fn new(n: usize, s: f64) -> Zipf {
        let n = n.max(1);
        let mut cdf = Vec::with_capacity(n);
        let mut acc = 0.0;
        for r in 1..=n {
            acc += (r as f64).powf(-s);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    /// The number of ranks.
    pub fn len(&self) -> usize {
        self.cdf.len()
    }

    /// Whether there are no ranks (never: [`Self::new`] makes at least one).
    pub fn is_empty(&self) -> bool {
        self.cdf.is_empty()
    }

    /// The rank (0-based) that uniform `u` in `[0, 1)` falls on.
    pub fn rank(&self, u: f64) -> usize {
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_follow_the_power_law() {
        let z = Zipf::new(4, 1.0);
        // Weights 1, 1/2, 1/3, 1/4 over 25/12.
        assert_eq!(z.rank(0.0), 0);
        assert_eq!(z.rank(0.47), 0);
        assert_eq!(z.rank(0.49), 1);
        assert_eq!(z.rank(0.75), 2);
        assert_eq!(z.rank(0.9999), 3);
        assert_eq!(z.len(), 4);
        assert_eq!(Zipf::new(0, 1.1).rank(0.5), 0);
    }
}
