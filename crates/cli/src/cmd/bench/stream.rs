//! The token streams of `bench offload`: Zipf draws over the vocabulary
//! (never EOS), or the documents of a token corpus read in turn. A
//! [`Streams`] holds the streams of a set of sequences and gives each its
//! next token.
//!
//! Invariants: the same source, seed and document range give the same
//! tokens in the same order; a corpus is read document after document
//! within the range given, a sequence taking the next unread document when
//! its own ends (so a long stream crosses document boundaries, as a
//! server's next request on a slot would), and reading wraps to the
//! range's start after its last document ([`Streams::reread`] says when it
//! did, so a report can say the range was read more than once).

use std::ops::Range;
use std::sync::Arc;

use crate::cmd::common::Zipf;

/// Where the tokens come from.
#[derive(Clone)]
pub enum Source {
    /// Zipf draws over the vocabulary.
    Zipf(Arc<Zipf>),
    /// The documents of a corpus (each non-empty).
    Corpus(Arc<Vec<Vec<u32>>>),
}

impl Source {
    /// Documents in the corpus (0 for Zipf draws).
    pub fn documents(&self) -> usize {
        match self {
            Source::Zipf(_) => 0,
            Source::Corpus(d) => d.len(),
        }
    }

    /// The documents from `from` to `to` of the way through the corpus
    /// (fractions; at least one document; empty for Zipf draws).
    pub fn docs(&self, from: f64, to: f64) -> Range<usize> {
        let n = self.documents();
        if n == 0 {
            return 0..0;
        }
        let at = |f: f64| ((n as f64 * f) as usize).min(n);
        let lo = at(from).min(n - 1);
        lo..at(to).max(lo + 1)
    }
}

/// The token streams of `n` sequences.
pub struct Streams {
    source: Source,
    /// The Zipf draws' generator state.
    state: u64,
    /// Per sequence, the document and position of its next token.
    at: Vec<(usize, usize)>,
    range: Range<usize>,
    next_doc: usize,
    taken: usize,
}

impl Streams {
    /// `n` streams of `source`: Zipf draws from `seed`, or the corpus's
    /// documents `docs` (see [`Source::docs`]), one to each sequence in
    /// turn.
    pub fn new(source: &Source, seed: u64, n: usize, docs: Range<usize>) -> Streams {
        let mut s = Streams {
            source: source.clone(),
            state: seed,
            at: Vec::with_capacity(n),
            next_doc: docs.start,
            range: docs,
            taken: 0,
        };
        for _ in 0..n {
            let d = s.take_doc();
            s.at.push((d, 0));
        }
        s
    }

    fn take_doc(&mut self) -> usize {
        if self.range.is_empty() {
            return 0;
        }
        let d = if self.range.contains(&self.next_doc) {
            self.next_doc
        } else {
            self.range.start
        };
        self.next_doc = d + 1;
        self.taken += 1;
        d
    }

    /// Whether the streams started more documents than their range holds
    /// (so some were read twice); never for Zipf draws.
    pub fn reread(&self) -> bool {
        !self.range.is_empty() && self.taken > self.range.len()
    }

    /// The next token of sequence `seq`.
    pub fn next(&mut self, seq: usize) -> u32 {
        match &self.source {
            Source::Zipf(z) => z.sample(&mut self.state),
            Source::Corpus(docs) => {
                let (d, p) = self.at[seq];
                let doc = &docs[d];
                let t = doc[p];
                self.at[seq] = if p + 1 < doc.len() {
                    (d, p + 1)
                } else {
                    let next = self.take_doc();
                    (next, 0)
                };
                t
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_streams_read_documents_in_turn_and_wrap() {
        let docs = Arc::new(vec![vec![9], vec![1, 2], vec![3], vec![4, 5, 6]]);
        let source = Source::Corpus(docs);
        assert_eq!(source.docs(0.0, 1.0), 0..4);
        assert_eq!(source.docs(0.25, 1.0), 1..4);
        assert_eq!(source.docs(0.9, 1.0), 3..4);
        let mut s = Streams::new(&source, 0, 2, 1..4);
        // Sequence 0 starts on document 1, sequence 1 on document 2, whose
        // end takes document 3, the last of the range.
        assert_eq!([s.next(0), s.next(1)], [1, 3]);
        assert!(!s.reread());
        // Document 1 ends: sequence 0 wraps to the range's start (document
        // 1 again, never document 0).
        assert_eq!([s.next(0), s.next(1), s.next(1)], [2, 4, 5]);
        // Document 3 ends: sequence 1 takes document 2.
        assert_eq!([s.next(0), s.next(1), s.next(0)], [1, 6, 2]);
        assert_eq!(s.next(1), 3);
        assert!(s.reread());
    }

    #[test]
    fn zipf_streams_repeat_with_their_seed() {
        let z = Source::Zipf(Arc::new(Zipf::new(100, 7, 1.1)));
        let draw = |seed| {
            let mut s = Streams::new(&z, seed, 3, z.docs(0.0, 1.0));
            (0..20).map(|i| s.next(i % 3)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
        assert!(draw(5).iter().all(|&t| t < 100 && t != 7));
    }
}
