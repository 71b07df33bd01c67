//! The token streams of `bench offload`: Zipf draws over the vocabulary
//! (never EOS), or the documents of a token corpus read in turn. A
//! [`Streams`] holds the streams of a set of sequences and gives each its
//! next token.
//!
//! Invariants: the same source, seed and first document give the same
//! tokens in the same order; a corpus is read document after document from
//! the first one given, a sequence taking the next unread document when its
//! own ends (so a long stream crosses document boundaries, as a server's
//! next request on a slot would), and reading wraps to the corpus's start
//! after its last document ([`Streams::documents`] counts the documents
//! taken, so a report can say when a corpus was read more than once).

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

    /// The document a stream set starting `part` of the way into the
    /// corpus begins with (0 for Zipf draws).
    pub fn doc_at(&self, part: f64) -> usize {
        let n = self.documents();
        if n == 0 {
            return 0;
        }
        ((n as f64 * part) as usize).min(n - 1)
    }
}

/// The token streams of `n` sequences.
pub struct Streams {
    source: Source,
    /// The Zipf draws' generator state.
    state: u64,
    /// Per sequence, the document and position of its next token.
    at: Vec<(usize, usize)>,
    next_doc: usize,
    taken: usize,
}

impl Streams {
    /// `n` streams of `source`: Zipf draws from `seed`, or the corpus's
    /// documents from `first_doc` on, one to each sequence in turn.
    pub fn new(source: &Source, seed: u64, n: usize, first_doc: usize) -> Streams {
        let mut s = Streams {
            source: source.clone(),
            state: seed,
            at: Vec::with_capacity(n),
            next_doc: first_doc,
            taken: 0,
        };
        for _ in 0..n {
            let d = s.take_doc();
            s.at.push((d, 0));
        }
        s
    }

    fn take_doc(&mut self) -> usize {
        let n = self.source.documents();
        if n == 0 {
            return 0;
        }
        let d = self.next_doc % n;
        self.next_doc = d + 1;
        self.taken += 1;
        d
    }

    /// Documents the streams have started so far (0 for Zipf draws).
    pub fn documents(&self) -> usize {
        self.taken
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
        let docs = Arc::new(vec![vec![1, 2], vec![3], vec![4, 5, 6]]);
        let mut s = Streams::new(&Source::Corpus(docs), 0, 2, 1);
        // Sequence 0 starts on document 1, sequence 1 on document 2.
        assert_eq!([s.next(0), s.next(1)], [3, 4]);
        // Document 1 ends: sequence 0 takes document 0 (wrapped).
        assert_eq!([s.next(0), s.next(0), s.next(1)], [1, 2, 5]);
        // Documents 1, 2, then 0 again.
        assert_eq!([s.next(0), s.next(1), s.next(1)], [3, 6, 1]);
        assert_eq!(s.documents(), 6);
    }

    #[test]
    fn zipf_streams_repeat_with_their_seed() {
        let z = Source::Zipf(Arc::new(Zipf::new(100, 7, 1.1)));
        let draw = |seed| {
            let mut s = Streams::new(&z, seed, 3, 0);
            (0..20).map(|i| s.next(i % 3)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
        assert!(draw(5).iter().all(|&t| t < 100 && t != 7));
    }
}
