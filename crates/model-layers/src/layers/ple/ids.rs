//! The PLE n-gram id hash (docs/SPEC.md, "Id hash"): which table rows each token
//! reads.
//!
//! For token `i` and order `n` in `2..=N`, `mixed = XOR over p < n of
//! shift_p[i] * m[p]` (wrapping), where `shift_p[i]` is the token `p`
//! places back within the current EOS-delimited segment, else EOS; head `h`
//! of that order reads row `mixed % size[h] + offset[h]`.
//!
//! Three forms share one kernel and so agree bit for bit:
//! - [`ple_ngram_ids`] and [`ple_ngram_ids_into_plain`]: the straightforward
//!   `%` form, the reference the others are tested against;
//! - [`PleIdHasher`]: the hot path. Each modulus is replaced by a
//!   precomputed reciprocal ([`FastMod`], exact for every `u64`) and the
//!   ids go into a caller's flat buffer with no allocation;
//! - [`PleIdHasher::decode_batch_into`]: one new token in each of many
//!   sequences, each with its own history (batched decode).
//!
//! Invariants:
//! - the hash of `history ++ tokens`, keeping the last `tokens.len()` rows,
//!   depends only on the last `context_len` tokens of the history, and a
//!   shorter history acts as if left-padded with EOS (a sequence start);
//!   so hashing in chunks with [`PleIdDims::advance_history`] between them
//!   equals hashing the whole sequence (`tests/ids_chunking.rs`);
//! - for dims that pass [`PleIdDims::validate`], every id is below
//!   [`PleIdDims::table_rows`];
//! - the per-token context lives on the stack (`ngram_size` is capped at
//!   [`MAX_NGRAM_SIZE`]), so the hot path never allocates.
//!
//! Why one long file: the dims, the hash loop and [`PleIdHasher`] are one
//! hot path, monomorphised over the context length and the row reduction
//! so that the compiler sees it whole; the families' hashes, the SIMD
//! kernels and the tests already live in `ids/`.

mod derive;
mod engram;
mod error;
mod family;
mod fastmod;
mod longcat;
#[cfg(target_arch = "x86_64")]
mod simd;

use error::{id_bail, id_ensure};

/// The result of an id-hash operation.
type Result<T, E = IdError> = std::result::Result<T, E>;

pub use derive::{
    DEFAULT_DIVISIBLE_BY, DEFAULT_HASH_SEED, DerivedPleIds, MAX_NGRAM_SIZE, MAX_PRIMES_SEARCHED,
    PleHashParams, SITE_SEED_STRIDE, SPLITMIX64_GAMMA, check_stored_buffers, derive_multipliers,
    is_prime, primes_from, splitmix64,
};
pub use engram::{
    Boundaries, engram_head_sizes, engram_ids_bounded_into, engram_multipliers, running_offsets,
};
pub use error::IdError;
pub use family::{HashFamily, TokenMap, check_tokens, longcat_weights, validate_family};
pub use fastmod::FastMod;
pub use longcat::{longcat_layout, longcat_sizes};

/// The hash geometry and constants of one PLE site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PleIdDims {
    /// N: the largest n-gram order (orders 2..=N are hashed).
    pub ngram_size: usize,
    /// K: heads per order.
    pub heads_per_ngram: usize,
    /// One odd multiplier per position `0..N`.
    pub multipliers: Vec<u64>,
    /// One modulus (a prime) per head.
    pub head_vocab_sizes: Vec<u64>,
    /// Running sums of `head_vocab_sizes`.
    pub head_offsets: Vec<u64>,
    /// The EOS token that starts every sequence and ends segments (for
    /// another family: the fill token of a fresh history, see `family`).
    pub eos_token_id: u32,
    /// How n-grams map to rows with these constants (docs/SPEC.md §11
    /// (Families)); every hash of these dims ([`ple_ngram_ids`],
    /// [`ple_ngram_ids_into_plain`], [`PleIdHasher::new`]) follows it.
    pub family: HashFamily,
}

impl PleIdDims {
    /// `(N - 1) * K`.
    pub fn ngram_heads(&self) -> usize {
        self.ngram_size.saturating_sub(1) * self.heads_per_ngram
    }

    /// `N - 1`: tokens of history carried per sequence.
    pub fn context_len(&self) -> usize {
        self.ngram_size.saturating_sub(1)
    }

    /// Rows the ids can address: the sum of the head sizes (before
    /// padding). Meaningful once [`Self::validate`] has passed.
    pub fn table_rows(&self) -> u64 {
        match (self.head_offsets.last(), self.head_vocab_sizes.last()) {
            (Some(&o), Some(&s)) => o.saturating_add(s),
            _ => 0,
        }
    }

    /// Check that the dims describe a usable hash: `ngram_size` in
    /// `2..=MAX_NGRAM_SIZE`, at least one head per order, one odd multiplier
    /// per position (none for LongCat), one non-zero size and one offset per
    /// head, offsets the running sums of the sizes from 0, the last id
    /// within `u64`, and what the family adds ([`validate_family`]).
    pub fn validate(&self) -> Result<()> {
        validate_family(&self.family, self)
    }

    /// [`Self::validate`], with `multipliers` false for a family that has
    /// none (LongCat): then the list must be empty.
    pub(crate) fn validate_layout(&self, multipliers: bool) -> Result<()> {
        let n = self.ngram_size;
        id_ensure!(
            (2..=MAX_NGRAM_SIZE).contains(&n),
            Dims,
            "PleIdDims: ngram_size must be in 2..={MAX_NGRAM_SIZE}, got {n}"
        );
        id_ensure!(
            self.heads_per_ngram >= 1,
            Dims,
            "PleIdDims: heads_per_ngram must be at least 1, got 0"
        );
        let heads = (n - 1).checked_mul(self.heads_per_ngram).ok_or_else(|| {
            IdError::Dims(format!(
                "PleIdDims: ngram_heads = {} * {} overflows",
                n - 1,
                self.heads_per_ngram
            ))
        })?;
        let want = if multipliers { n } else { 0 };
        id_ensure!(
            self.multipliers.len() == want,
            Dims,
            "PleIdDims: {} multipliers given, ngram_size {n} needs {want}",
            self.multipliers.len()
        );
        if let Some((i, m)) = self
            .multipliers
            .iter()
            .enumerate()
            .find(|(_, m)| *m % 2 == 0)
        {
            id_bail!(
                Dims,
                "PleIdDims: multipliers[{i}] = {m} is even; every multiplier must be odd"
            );
        }
        id_ensure!(
            self.head_vocab_sizes.len() == heads,
            Dims,
            "PleIdDims: {} head_vocab_sizes given, ngram_heads is {heads}",
            self.head_vocab_sizes.len()
        );
        id_ensure!(
            self.head_offsets.len() == heads,
            Dims,
            "PleIdDims: {} head_offsets given, ngram_heads is {heads}",
            self.head_offsets.len()
        );
        let mut running = 0u64;
        for (h, (&size, &off)) in self
            .head_vocab_sizes
            .iter()
            .zip(&self.head_offsets)
            .enumerate()
        {
            id_ensure!(size != 0, Dims, "PleIdDims: head_vocab_sizes[{h}] is 0");
            id_ensure!(
                off == running,
                Dims,
                "PleIdDims: head_offsets[{h}] = {off}, but the sizes of heads 0..{h} sum to {running}"
            );
            running = running.checked_add(size).ok_or_else(|| {
                IdError::Dims(format!(
                    "PleIdDims: head {h} ends past 2^64 - 1 (offset {off} + size {size})"
                ))
            })?;
        }
        Ok(())
    }

    /// Check that every id fits in a table of `rows` rows.
    pub fn check_table_rows(&self, rows: u64) -> Result<()> {
        let need = self.table_rows();
        if need > rows {
            return Err(IdError::TableRows {
                last: need.saturating_sub(1),
                rows,
            });
        }
        Ok(())
    }

    /// Replace `history` by the last `context_len` tokens of
    /// `history ++ tokens`, left-padded with EOS when that is shorter (which
    /// hashes the same). Reuses `history`'s buffer.
    pub fn advance_history(&self, history: &mut Vec<u32>, tokens: &[u32]) {
        let c = self.context_len();
        if tokens.len() >= c {
            history.clear();
            history.extend_from_slice(&tokens[tokens.len() - c..]);
            return;
        }
        let keep = c - tokens.len();
        let have = history.len();
        if have >= keep {
            history.drain(..have - keep);
        } else {
            history.resize(keep, self.eos_token_id);
            history.rotate_right(keep - have);
        }
        history.extend_from_slice(tokens);
    }
}

/// How one head turns the mixed value into a row id.
trait HeadRows {
    /// `mixed % size[h] + offset[h]` for the heads of order `order + 2`,
    /// written to `out` (one entry per head of that order, the first being
    /// head `first`).
    fn order_rows(&self, order: usize, first: usize, mixed: u64, out: &mut [u64]);
}

/// The `%` form.
struct PlainRows<'a> {
    sizes: &'a [u64],
    offsets: &'a [u64],
}

impl HeadRows for PlainRows<'_> {
    #[inline(always)]
    fn order_rows(&self, _order: usize, first: usize, mixed: u64, out: &mut [u64]) {
        let k = out.len();
        let sizes = &self.sizes[first..first + k];
        let offsets = &self.offsets[first..first + k];
        for ((o, &s), &off) in out.iter_mut().zip(sizes).zip(offsets) {
            *o = mixed % s + off;
        }
    }
}

/// A head's reciprocal and offset, kept together for locality.
#[derive(Clone, Copy, Debug)]
struct HeadMod {
    m: FastMod,
    offset: u64,
}

struct FastRows<'a> {
    heads: &'a [HeadMod],
}

impl HeadRows for FastRows<'_> {
    #[inline(always)]
    fn order_rows(&self, _order: usize, first: usize, mixed: u64, out: &mut [u64]) {
        let heads = &self.heads[first..first + out.len()];
        for (o, h) in out.iter_mut().zip(heads) {
            *o = h.m.rem(mixed) + h.offset;
        }
    }
}

/// The tokens 1..N places back of the next token, within its segment,
/// else EOS (`prev()[p - 1]` is `shift_p`).
trait Context: Copy {
    /// A sequence start: everything before it reads as EOS.
    fn start(ctx_len: usize, eos: u32) -> Self;
    /// The context, nearest token first.
    fn prev(&self) -> &[u32];
    /// Move past token `t`. After an EOS a new segment starts, and every
    /// position before it reads as EOS.
    fn push(&mut self, t: u32, eos: u32);

    /// The context after the last `ctx_len` tokens of `history` (earlier
    /// tokens cannot reach a later n-gram).
    #[inline(always)]
    fn after(history: &[u32], ctx_len: usize, eos: u32) -> Self {
        let mut c = Self::start(ctx_len, eos);
        for &t in &history[history.len().saturating_sub(ctx_len)..] {
            c.push(t, eos);
        }
        c
    }
}

/// A context whose length is known at compile time (N = 2, 3, 4), so the
/// shift and the per-order loop unroll.
#[derive(Clone, Copy)]
struct FixedContext<const C: usize>([u32; C]);

impl<const C: usize> Context for FixedContext<C> {
    #[inline(always)]
    fn start(_ctx_len: usize, eos: u32) -> Self {
        Self([eos; C])
    }
    #[inline(always)]
    fn prev(&self) -> &[u32] {
        &self.0
    }
    #[inline(always)]
    fn push(&mut self, t: u32, eos: u32) {
        if t == eos {
            self.0 = [eos; C];
        } else {
            for i in (1..C).rev() {
                self.0[i] = self.0[i - 1];
            }
            self.0[0] = t;
        }
    }
}

/// Any context length up to `MAX_NGRAM_SIZE - 1`.
#[derive(Clone, Copy)]
struct DynContext {
    prev: [u32; MAX_NGRAM_SIZE - 1],
    len: usize,
}

impl Context for DynContext {
    #[inline(always)]
    fn start(ctx_len: usize, eos: u32) -> Self {
        Self {
            prev: [eos; MAX_NGRAM_SIZE - 1],
            len: ctx_len,
        }
    }
    #[inline(always)]
    fn prev(&self) -> &[u32] {
        &self.prev[..self.len]
    }
    #[inline(always)]
    fn push(&mut self, t: u32, eos: u32) {
        if t == eos {
            self.prev[..self.len].fill(eos);
        } else {
            self.prev.copy_within(0..self.len - 1, 1);
            self.prev[0] = t;
        }
    }
}

/// The ids of token `t` (one row of `ngram_heads`) given its context.
/// `mults` has `prev.len() + 1` entries and `out` `prev.len() * k`.
#[inline(always)]
fn hash_token<R: HeadRows>(
    mults: &[u64],
    k: usize,
    prev: &[u32],
    t: u32,
    rows: &R,
    out: &mut [u64],
) {
    let mults = &mults[..prev.len() + 1];
    let mut mixed = u64::from(t).wrapping_mul(mults[0]);
    for p in 0..prev.len() {
        mixed ^= u64::from(prev[p]).wrapping_mul(mults[p + 1]);
        rows.order_rows(p, p * k, mixed, &mut out[p * k..(p + 1) * k]);
    }
}

/// Hash `history ++ tokens` and write the rows of `tokens` to `out`
/// (`tokens.len() * ngram_heads`, checked by the caller).
#[inline(always)]
fn hash_run_with<C: Context, R: HeadRows>(
    dims: &PleIdDims,
    rows: &R,
    history: &[u32],
    tokens: &[u32],
    out: &mut [u64],
) {
    let eos = dims.eos_token_id;
    let k = dims.heads_per_ngram;
    let mut ctx = C::after(history, dims.context_len(), eos);
    for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(dims.ngram_heads())) {
        hash_token(&dims.multipliers, k, ctx.prev(), t, rows, row);
        ctx.push(t, eos);
    }
}

/// [`hash_run_with`], with the context length fixed at compile time for the
/// common orders. Always inlined, so that a caller compiled for a wider
/// instruction set gets the whole loop compiled for it.
#[inline(always)]
fn hash_run<R: HeadRows>(
    dims: &PleIdDims,
    rows: &R,
    history: &[u32],
    tokens: &[u32],
    out: &mut [u64],
) {
    match dims.context_len() {
        1 => hash_run_with::<FixedContext<1>, R>(dims, rows, history, tokens, out),
        2 => hash_run_with::<FixedContext<2>, R>(dims, rows, history, tokens, out),
        3 => hash_run_with::<FixedContext<3>, R>(dims, rows, history, tokens, out),
        _ => hash_run_with::<DynContext, R>(dims, rows, history, tokens, out),
    }
}

/// One new token after each history (batched decode).
#[inline(always)]
fn hash_batch_with<'h, C: Context, R: HeadRows>(
    dims: &PleIdDims,
    rows: &R,
    histories: impl Iterator<Item = &'h [u32]>,
    tokens: &[u32],
    out: &mut [u64],
) {
    let (ctx_len, eos, k) = (dims.context_len(), dims.eos_token_id, dims.heads_per_ngram);
    for ((h, &t), row) in histories
        .zip(tokens)
        .zip(out.chunks_exact_mut(dims.ngram_heads()))
    {
        let ctx = C::after(h, ctx_len, eos);
        hash_token(&dims.multipliers, k, ctx.prev(), t, rows, row);
    }
}

#[inline(always)]
fn hash_batch<'h, R: HeadRows>(
    dims: &PleIdDims,
    rows: &R,
    histories: impl Iterator<Item = &'h [u32]>,
    tokens: &[u32],
    out: &mut [u64],
) {
    match dims.context_len() {
        1 => hash_batch_with::<FixedContext<1>, R>(dims, rows, histories, tokens, out),
        2 => hash_batch_with::<FixedContext<2>, R>(dims, rows, histories, tokens, out),
        3 => hash_batch_with::<FixedContext<3>, R>(dims, rows, histories, tokens, out),
        _ => hash_batch_with::<DynContext, R>(dims, rows, histories, tokens, out),
    }
}

fn check_out(what: &str, out_len: usize, tokens: usize, heads: usize) -> Result<()> {
    let want = tokens.checked_mul(heads);
    id_ensure!(
        want == Some(out_len),
        Shape,
        "{what}: output buffer has {out_len} entries, {tokens} tokens x {heads} heads need {}",
        tokens.saturating_mul(heads)
    );
    Ok(())
}

/// The ids of the n-grams ending at each token of `tokens` (history first),
/// one row of `ngram_heads` ids per token. The straightforward form the
/// seed calls; the hot path is [`PleIdHasher`].
///
/// Follows `dims.family`.
///
/// # Panics
/// If `dims` fails [`PleIdDims::validate`] (dims come from
/// [`PleHashParams::derive`] or are validated when a layer is built), or a
/// token is outside the vocabulary of a family that bounds it (Engram,
/// LongCat: [`IdError::TokenOutOfRange`]); [`PleIdHasher`] returns both as
/// errors instead.
pub fn ple_ngram_ids(dims: &PleIdDims, tokens: &[u32]) -> Vec<Vec<u64>> {
    if let Err(e) = dims.validate() {
        panic!("ple_ngram_ids called with invalid dims: {e:#}");
    }
    let heads = dims.ngram_heads();
    let mut flat = vec![0u64; tokens.len() * heads];
    if let Err(e) = family_ids_into_plain(&dims.family, dims, &[], tokens, &mut flat) {
        panic!("ple_ngram_ids: {e:#}");
    }
    flat.chunks_exact(heads).map(<[u64]>::to_vec).collect()
}

/// The `%` form of [`PleIdHasher::ids_with_history_into`]: hash
/// `history ++ tokens` and write the `tokens.len() * ngram_heads` ids of
/// `tokens`, row-major, to `out`. The baseline for tests and benchmarks.
/// Follows `dims.family` (as [`family_ids_into_plain`] with it).
pub fn ple_ngram_ids_into_plain(
    dims: &PleIdDims,
    history: &[u32],
    tokens: &[u32],
    out: &mut [u64],
) -> Result<()> {
    plain_into(
        "ple_ngram_ids_into_plain",
        &dims.family,
        dims,
        history,
        tokens,
        out,
    )
}

/// The `%` form of any family (docs/SPEC.md, "Families"): hash `history ++
/// tokens` with the constants of `dims` and the family `family` (which
/// takes the place of `dims.family`) and write the `tokens.len() *
/// ngram_heads` ids of `tokens`, row-major, to `out`. The families other
/// than Qwen4Exp refuse out-of-vocabulary tokens first
/// ([`IdError::TokenOutOfRange`]) and write nothing then.
pub fn family_ids_into_plain(
    family: &HashFamily,
    dims: &PleIdDims,
    history: &[u32],
    tokens: &[u32],
    out: &mut [u64],
) -> Result<()> {
    plain_into("family_ids_into_plain", family, dims, history, tokens, out)
}

/// [`family_ids_into_plain`], its errors naming `what`.
fn plain_into(
    what: &str,
    family: &HashFamily,
    dims: &PleIdDims,
    history: &[u32],
    tokens: &[u32],
    out: &mut [u64],
) -> Result<()> {
    validate_family(family, dims)?;
    check_out(what, out.len(), tokens.len(), dims.ngram_heads())?;
    // Nothing to refuse for a rule without a token limit (Qwen4Exp).
    check_tokens(family, "history", history)?;
    check_tokens(family, "tokens", tokens)?;
    let rows = PlainRows {
        sizes: &dims.head_vocab_sizes,
        offsets: &dims.head_offsets,
    };
    match family::Prepared::new(family, dims) {
        family::Prepared::Qwen4Exp => hash_run(dims, &rows, history, tokens, out),
        family::Prepared::Engram { map, fill } => {
            family::engram_run(dims, map.as_deref(), fill, &rows, history, tokens, out);
        }
        family::Prepared::LongCat { weights, .. } => {
            family::longcat_run(dims, &weights, history, tokens, out);
        }
    }
    Ok(())
}

/// The hot path: validated dims with a precomputed reciprocal per head.
/// Build one per PLE site and reuse it; hashing allocates nothing.
///
/// On x86_64 CPUs with AVX2, and head sizes in `[2^16, 2^32)` (the flagship
/// geometry's are about 2^24), four heads are reduced at once (see
/// `ids/simd.rs`); otherwise, or when built with [`Self::new_portable`],
/// one [`FastMod`] per head. Both are exact, so the choice never changes an
/// id; [`Self::path`] says which one runs.
#[derive(Clone, Debug)]
pub struct PleIdHasher {
    dims: PleIdDims,
    family: HashFamily,
    prep: family::Prepared,
    heads: Vec<HeadMod>,
    #[cfg(target_arch = "x86_64")]
    avx2: Option<simd::Avx2Plan>,
}

impl PleIdHasher {
    /// Validate `dims`, precompute the reciprocals and pick the fastest
    /// exact path this CPU supports for `dims.family` (the AVX2 reduction
    /// serves Qwen4Exp and Engram, whose heads reduce one mixed value each;
    /// LongCat runs its scalar kernel).
    pub fn new(dims: &PleIdDims) -> Result<Self> {
        #[allow(unused_mut)]
        let mut h = Self::new_portable(dims)?;
        #[cfg(target_arch = "x86_64")]
        if dims.family.mixes_once_per_order() {
            h.avx2 = simd::Avx2Plan::new(dims);
        }
        Ok(h)
    }

    /// Like [`Self::new`] but always on the portable scalar path.
    pub fn new_portable(dims: &PleIdDims) -> Result<Self> {
        dims.validate()?;
        Ok(Self::validated(&dims.family, dims))
    }

    /// The scalar-path hasher of a pair already validated (which rules
    /// out zero head sizes).
    fn validated(family: &HashFamily, dims: &PleIdDims) -> Self {
        let heads = dims
            .head_vocab_sizes
            .iter()
            .zip(&dims.head_offsets)
            .map(|(&s, &offset)| HeadMod {
                m: FastMod::new(s).expect("validated non-zero head size"),
                offset,
            })
            .collect();
        let mut own = dims.clone();
        own.family = family.clone();
        Self {
            prep: family::Prepared::new(family, &own),
            dims: own,
            family: family.clone(),
            heads,
            #[cfg(target_arch = "x86_64")]
            avx2: None,
        }
    }

    /// [`Self::new`] with `family` in place of `dims.family`: the AVX2 or
    /// scalar path for Qwen4Exp, the scalar family kernels otherwise
    /// (docs/SPEC.md, "Families"). The pair is checked with
    /// [`validate_family`].
    pub fn with_family(family: &HashFamily, dims: &PleIdDims) -> Result<Self> {
        if *family == dims.family {
            return Self::new(dims);
        }
        let mut dims = dims.clone();
        dims.family = family.clone();
        Self::new(&dims)
    }

    /// The hash family.
    pub fn family(&self) -> &HashFamily {
        &self.family
    }

    /// The scalar kernel of a family other than Qwen4Exp over `history ++
    /// tokens` (inputs already checked). Returns false for Qwen4Exp.
    fn family_run(&self, history: &[u32], tokens: &[u32], out: &mut [u64]) -> bool {
        match &self.prep {
            family::Prepared::Qwen4Exp => false,
            family::Prepared::Engram { map, fill } => {
                let (dims, map, fill) = (&self.dims, map.as_deref(), *fill);
                #[cfg(target_arch = "x86_64")]
                if let Some(plan) = &self.avx2 {
                    let rows = simd::Avx2Rows::new(plan, &self.heads);
                    // SAFETY: a plan is only built after AVX2 was detected.
                    unsafe { simd::engram_run_avx2(dims, map, fill, &rows, history, tokens, out) };
                    return true;
                }
                let rows = FastRows { heads: &self.heads };
                family::engram_run(dims, map, fill, &rows, history, tokens, out);
                true
            }
            family::Prepared::LongCat { weights, narrow } => {
                if *narrow {
                    family::longcat_run_narrow(
                        &self.dims,
                        weights,
                        &self.heads,
                        history,
                        tokens,
                        out,
                    );
                } else {
                    family::longcat_run(&self.dims, weights, history, tokens, out);
                }
                true
            }
        }
    }

    /// The reduction in use: `"avx2"` or `"scalar"`.
    pub fn path(&self) -> &'static str {
        #[cfg(target_arch = "x86_64")]
        if self.avx2.is_some() {
            return "avx2";
        }
        "scalar"
    }

    /// The dims this hasher was built from.
    pub fn dims(&self) -> &PleIdDims {
        &self.dims
    }

    /// Ids per token (`ngram_heads`).
    pub fn ngram_heads(&self) -> usize {
        self.dims.ngram_heads()
    }

    /// Like [`ple_ngram_ids`] (no history: `tokens` starts the sequence or
    /// already carries its history), flat and row-major into `out`, which
    /// must hold exactly `tokens.len() * ngram_heads` entries.
    pub fn ids_into(&self, tokens: &[u32], out: &mut [u64]) -> Result<()> {
        self.ids_with_history_into(&[], tokens, out)
    }

    /// Hash `history ++ tokens` and write the ids of `tokens` (the last
    /// `tokens.len()` rows) to `out`, which must hold exactly
    /// `tokens.len() * ngram_heads` entries. Only the last `context_len`
    /// history tokens matter; a shorter history acts as if EOS-padded.
    pub fn ids_with_history_into(
        &self,
        history: &[u32],
        tokens: &[u32],
        out: &mut [u64],
    ) -> Result<()> {
        check_out(
            "PleIdHasher::ids_with_history_into",
            out.len(),
            tokens.len(),
            self.ngram_heads(),
        )?;
        if !matches!(self.prep, family::Prepared::Qwen4Exp) {
            check_tokens(&self.family, "history", history)?;
            check_tokens(&self.family, "tokens", tokens)?;
            self.family_run(history, tokens, out);
            return Ok(());
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(plan) = &self.avx2 {
            let rows = simd::Avx2Rows::new(plan, &self.heads);
            // SAFETY: a plan is only built after AVX2 was detected.
            unsafe { simd::hash_run_avx2(&self.dims, &rows, history, tokens, out) };
            return Ok(());
        }
        hash_run(
            &self.dims,
            &FastRows { heads: &self.heads },
            history,
            tokens,
            out,
        );
        Ok(())
    }

    fn batch<'h>(
        &self,
        histories: impl Iterator<Item = &'h [u32]>,
        tokens: &[u32],
        out: &mut [u64],
    ) {
        if !matches!(self.prep, family::Prepared::Qwen4Exp) {
            let heads = self.ngram_heads();
            for ((h, t), row) in histories
                .zip(tokens.chunks(1))
                .zip(out.chunks_exact_mut(heads))
            {
                self.family_run(h, t, row);
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(plan) = &self.avx2 {
            let rows = simd::Avx2Rows::new(plan, &self.heads);
            // SAFETY: a plan is only built after AVX2 was detected.
            unsafe { simd::hash_batch_avx2(&self.dims, &rows, histories, tokens, out) };
            return;
        }
        let rows = FastRows { heads: &self.heads };
        hash_batch(&self.dims, &rows, histories, tokens, out);
    }

    /// Batched decode: one new token per sequence, `tokens[b]` following
    /// `histories[b]` (each as in [`Self::ids_with_history_into`]). Writes
    /// `tokens.len() * ngram_heads` ids, row `b` for sequence `b`. Histories
    /// are not advanced; call [`PleIdDims::advance_history`] per sequence.
    pub fn decode_batch_into<H: AsRef<[u32]>>(
        &self,
        histories: &[H],
        tokens: &[u32],
        out: &mut [u64],
    ) -> Result<()> {
        id_ensure!(
            histories.len() == tokens.len(),
            Shape,
            "PleIdHasher::decode_batch_into: {} histories for {} tokens",
            histories.len(),
            tokens.len()
        );
        check_out(
            "PleIdHasher::decode_batch_into",
            out.len(),
            tokens.len(),
            self.ngram_heads(),
        )?;
        if self.family.token_limit().is_some() {
            check_tokens(&self.family, "tokens", tokens)?;
            for h in histories {
                check_tokens(&self.family, "histories", h.as_ref())?;
            }
        }
        self.batch(histories.iter().map(AsRef::as_ref), tokens, out);
        Ok(())
    }

    /// [`Self::decode_batch_into`] with the histories in one flat buffer of
    /// `tokens.len() * context_len` tokens, sequence `b` at
    /// `[b * context_len, (b + 1) * context_len)`.
    pub fn decode_batch_flat_into(
        &self,
        histories: &[u32],
        tokens: &[u32],
        out: &mut [u64],
    ) -> Result<()> {
        let c = self.dims.context_len();
        id_ensure!(
            Some(histories.len()) == tokens.len().checked_mul(c),
            Shape,
            "PleIdHasher::decode_batch_flat_into: histories hold {} tokens, {} sequences x context_len {c} need {}",
            histories.len(),
            tokens.len(),
            tokens.len().saturating_mul(c)
        );
        check_out(
            "PleIdHasher::decode_batch_flat_into",
            out.len(),
            tokens.len(),
            self.ngram_heads(),
        )?;
        check_tokens(&self.family, "tokens", tokens)?;
        check_tokens(&self.family, "histories", histories)?;
        self.batch(histories.chunks_exact(c), tokens, out);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
