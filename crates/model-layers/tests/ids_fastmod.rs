//! `FastMod` is exactly `%` and `/`: over the whole `u64` range, for every
//! divisor width, and at the edges where a reciprocal method would slip
//! (0, `u64::MAX`, multiples of `d` and their neighbours).

use metrale_model_layers::layers::ple::ids::FastMod;
use proptest::prelude::*;

fn check(d: u64, n: u64) -> Result<(), TestCaseError> {
    let f = FastMod::new(d).unwrap();
    prop_assert_eq!(f.rem(n), n % d, "{} % {}", n, d);
    prop_assert_eq!(f.div(n), n / d, "{} / {}", n, d);
    Ok(())
}

/// Divisors of every bit width, not just uniformly large ones.
fn any_divisor() -> impl Strategy<Value = u64> {
    (0u32..64, any::<u64>()).prop_map(|(bits, r)| {
        let top = 1u64 << bits;
        (top | (r & (top - 1))).max(1)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn matches_rem_for_any_divisor(d in any_divisor(), n in any::<u64>()) {
        check(d, n)?;
    }

    #[test]
    fn matches_rem_for_head_sized_divisors(d in (1u64 << 24)..=(u32::MAX as u64), n in any::<u64>()) {
        check(d, n)?;
    }

    #[test]
    fn matches_rem_at_edges(d in any_divisor(), k in any::<u64>()) {
        for n in [0, 1, d - 1, d, u64::MAX, u64::MAX - 1, u64::MAX - d + 1] {
            check(d, n)?;
        }
        // A multiple of d and its neighbours, anywhere in range.
        let q = k % (u64::MAX / d).max(1);
        let m = q * d;
        for n in [m.saturating_sub(1), m, m.saturating_add(1), m.saturating_add(d - 1)] {
            check(d, n)?;
        }
        // The largest multiple of d in u64.
        let top = (u64::MAX / d) * d;
        for n in [top - 1, top, u64::MAX] {
            check(d, n)?;
        }
    }
}

#[test]
fn every_divisor_near_powers_of_two() {
    for bits in 0..64 {
        let p = 1u64 << bits;
        for d in [p.saturating_sub(1), p, p.saturating_add(1)] {
            if d == 0 {
                continue;
            }
            for n in [
                0,
                1,
                d - 1,
                d,
                d.saturating_add(1),
                u64::MAX,
                u64::MAX - 1,
                1 << 63,
            ] {
                let f = FastMod::new(d).unwrap();
                assert_eq!(f.rem(n), n % d, "{n} % {d}");
            }
        }
    }
}
