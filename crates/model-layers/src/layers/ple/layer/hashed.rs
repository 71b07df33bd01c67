//! Row ids hashed ahead of the forwards that gather them: a scheduler that
//! hashes a step's tokens to start their reads ([`PleLayer::hash_ahead`],
//! then `RowTable::prefetch` on [`HashedIds::ids`]) hands the same ids to
//! the step's forwards (`forward_hashed`, `forward_batch_hashed`,
//! `prestage_batch_hashed`), so each id is hashed once per step.
//!
//! Invariant: an entry is keyed by the carried history the layer hashes
//! against (the last `context_len` tokens, EOS-padded as a fresh carry's)
//! and the tokens, and its ids are the hash of exactly that key, so a
//! forward uses them only where its own key is equal and otherwise hashes
//! as without them: handing ids over never changes an output bit, however
//! old the entries.

use super::{PleLayer, Result};

/// One `(history, tokens)` pair of a [`HashedIds`].
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// Start of its carried history in `HashedIds::hist` (`context_len`
    /// tokens).
    hist: usize,
    /// Start of its tokens in `HashedIds::toks`.
    toks: usize,
    /// Its number of tokens (`ngram_heads` ids each, from
    /// `toks * ngram_heads` in `HashedIds::ids`).
    len: usize,
}

/// The ids of several sequences' next tokens, hashed once by
/// [`PleLayer::hash_ahead`]. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct HashedIds {
    ctxl: usize,
    heads: usize,
    entries: Vec<Entry>,
    hist: Vec<u32>,
    toks: Vec<u32>,
    ids: Vec<u64>,
}

impl HashedIds {
    /// Every id, entry after entry (what a prefetch reads).
    pub fn ids(&self) -> &[u64] {
        &self.ids
    }

    /// Number of `(history, tokens)` entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds no entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry for carried history `history` (exactly `context_len`
    /// tokens) and `tokens`, searched from entry `from` on (wrapping), as
    /// a step's forwards come in the order the step was hashed.
    fn find(&self, history: &[u32], tokens: &[u32], from: usize) -> Option<usize> {
        let n = self.entries.len();
        if n == 0 || history.len() != self.ctxl {
            return None;
        }
        (0..n).map(|k| (from + k) % n).find(|&k| {
            let e = self.entries[k];
            e.len == tokens.len()
                && self.toks[e.toks..e.toks + e.len] == *tokens
                && self.hist[e.hist..e.hist + self.ctxl] == *history
        })
    }

    /// The ids of `tokens` after carried history `history`, if an entry
    /// holds them.
    pub(super) fn lookup(&self, history: &[u32], tokens: &[u32]) -> Option<&[u64]> {
        let k = self.find(history, tokens, 0)?;
        let e = self.entries[k];
        Some(&self.ids[e.toks * self.heads..(e.toks + e.len) * self.heads])
    }

    /// Fill `out` (`tokens.len() * ngram_heads`) with the ids of one token
    /// per sequence, `tokens[i]` after carried history `histories[i]`.
    /// `false` (with `out` partly written) unless every one was found.
    pub(super) fn fill_batch(&self, histories: &[&[u32]], tokens: &[u32], out: &mut [u64]) -> bool {
        let h = self.heads;
        if histories.len() != tokens.len() || out.len() != tokens.len() * h {
            return false;
        }
        let mut from = 0;
        for (i, (hist, tok)) in histories.iter().zip(tokens).enumerate() {
            let Some(k) = self.find(hist, std::slice::from_ref(tok), from) else {
                return false;
            };
            let at = self.entries[k].toks * h;
            out[i * h..(i + 1) * h].copy_from_slice(&self.ids[at..at + h]);
            from = k + 1;
        }
        true
    }
}

impl PleLayer {
    /// Hash the next tokens of several sequences at once: entry `i` holds
    /// the tokens a sequence ends with (only the last `context_len` matter;
    /// a shorter one acts as if EOS-padded, as for a fresh carry) and the
    /// tokens its next forward runs. Start their reads with
    /// `table().prefetch(hashed.ids())` and hand the result to the
    /// `*_hashed` forwards, which then hash nothing they find in it.
    pub fn hash_ahead(&self, work: &[(&[u32], &[u32])]) -> Result<HashedIds> {
        self.check_live()?;
        let ctxl = self.dims.context_len();
        let heads = self.dims.ngram_heads();
        let total: usize = work.iter().map(|(_, t)| t.len()).sum();
        let mut out = HashedIds {
            ctxl,
            heads,
            entries: Vec::with_capacity(work.len()),
            hist: Vec::with_capacity(work.len() * ctxl),
            toks: Vec::with_capacity(total),
            ids: vec![0u64; total * heads],
        };
        let mut carried = Vec::with_capacity(ctxl);
        for (history, tokens) in work {
            if tokens.is_empty() {
                continue;
            }
            // The history a carry holds after these tokens: EOS-padded
            // when shorter, as `reset` leaves a fresh one.
            carried.clear();
            self.dims.advance_history(&mut carried, history);
            let e = Entry {
                hist: out.hist.len(),
                toks: out.toks.len(),
                len: tokens.len(),
            };
            let ids = &mut out.ids[e.toks * heads..(e.toks + e.len) * heads];
            if e.len == 1 {
                // The batched step hashes one token per sequence this way.
                self.hasher
                    .decode_batch_into(&[carried.as_slice()], tokens, ids)?;
            } else {
                self.hasher.ids_with_history_into(&carried, tokens, ids)?;
            }
            out.hist.extend_from_slice(&carried);
            out.toks.extend_from_slice(tokens);
            out.entries.push(e);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two entries over a context of 2 and 2 heads: `[7, 8] + [9]` and
    /// `[1, 1] + [4, 5]`, with ids that name their entry and token.
    fn two() -> HashedIds {
        HashedIds {
            ctxl: 2,
            heads: 2,
            entries: vec![
                Entry {
                    hist: 0,
                    toks: 0,
                    len: 1,
                },
                Entry {
                    hist: 2,
                    toks: 1,
                    len: 2,
                },
            ],
            hist: vec![7, 8, 1, 1],
            toks: vec![9, 4, 5],
            ids: vec![10, 11, 20, 21, 30, 31],
        }
    }

    #[test]
    fn a_lookup_needs_the_same_history_and_tokens() {
        let h = two();
        assert_eq!(h.lookup(&[7, 8], &[9]), Some(&[10u64, 11][..]));
        assert_eq!(h.lookup(&[1, 1], &[4, 5]), Some(&[20u64, 21, 30, 31][..]));
        assert_eq!(h.lookup(&[8, 8], &[9]), None, "another history");
        assert_eq!(h.lookup(&[7, 8], &[4]), None, "another token");
        assert_eq!(
            h.lookup(&[1, 1], &[4]),
            None,
            "a prefix of an entry's tokens"
        );
        assert_eq!(h.lookup(&[8], &[9]), None, "a history of another length");
        assert_eq!(HashedIds::default().lookup(&[7, 8], &[9]), None);
    }

    #[test]
    fn a_batch_is_filled_only_when_every_sequence_is_found() {
        let mut h = two();
        // A third single-token entry, so a batch can name two in any order.
        h.entries.push(Entry {
            hist: 4,
            toks: 3,
            len: 1,
        });
        h.hist.extend([2, 3]);
        h.toks.push(6);
        h.ids.extend([40, 41]);
        let mut out = [0u64; 4];
        assert!(h.fill_batch(&[&[2, 3], &[7, 8]], &[6, 9], &mut out));
        assert_eq!(out, [40, 41, 10, 11]);
        assert!(h.fill_batch(&[&[7, 8], &[2, 3]], &[9, 6], &mut out));
        assert_eq!(out, [10, 11, 40, 41]);
        assert!(!h.fill_batch(&[&[7, 8], &[2, 3]], &[9, 7], &mut out));
        assert!(
            !h.fill_batch(&[&[7, 8]], &[9], &mut out),
            "out of another size"
        );
        assert!(
            !h.fill_batch(&[&[7, 8]], &[9, 6], &mut out[..2]),
            "lengths differ"
        );
    }
}
