//! [`SiteSpec`]: one PLE site, what its layer is built from, and every
//! size derived from it (docs/SPEC.md §2 (Geometry)); its [`Combine`]
//! says how the family turns rows into output (docs/SPEC.md §5 (Layer
//! math)).

use super::super::ids::validate_family;
use super::*;
use combine::Combine;

/// Everything about one PLE site: what a layer is built from, what decides
/// whether a carry means the same thing in another engine, and every size
/// derived from them.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteSpec {
    /// How token n-grams map to table rows: always `dims.family`
    /// ([`Self::validate`] refuses a site where they differ); kept here as
    /// well for the callers that read a site's family.
    pub family: HashFamily,
    /// The 0-based model layer the site sits on.
    pub layer: usize,
    /// The hash geometry and constants.
    pub dims: PleIdDims,
    /// Values per table row.
    pub head_dim: usize,
    /// H: the width of one highway stream.
    pub hidden: usize,
    /// hc: the number of highway streams.
    pub hc_mult: usize,
    /// The conv kernel size.
    pub kernel: usize,
    /// The conv dilation.
    pub dilation: usize,
    /// The epsilon of the grouped RMS norms (those a [`GatedSpec`] leaves
    /// unset).
    pub rms_eps: f32,
    /// How the gathered rows become the site's output.
    pub combine: Combine,
}

impl SiteSpec {
    /// A site of `dims.family` on model layer 0 with `rms_eps` 1e-6 (the
    /// models' value) and the Qwen4Exp combination: the usual site of tests
    /// and synthetic models. Set the public fields for anything else.
    pub fn new(
        dims: PleIdDims,
        head_dim: usize,
        hidden: usize,
        hc_mult: usize,
        kernel: usize,
        dilation: usize,
    ) -> SiteSpec {
        SiteSpec {
            family: dims.family.clone(),
            layer: 0,
            dims,
            head_dim,
            hidden,
            hc_mult,
            kernel,
            dilation,
            rms_eps: 1e-6,
            combine: Combine::qwen4exp(),
        }
    }

    /// The published layer the site follows, as messages name it
    /// (`"Qwen4-Exp"`, `"Engram demo"`, `"DeepSeek-V4.1 Engram"`, ...): its
    /// family decides from the site's hash rule and combination
    /// ([`family::site_layer`]), so a site built by hand is named too.
    pub fn published_layer(&self) -> &'static str {
        family::site_layer(self)
    }

    /// `(N - 1) * K`: ids (table rows) per token.
    pub fn ngram_heads(&self) -> usize {
        self.dims.ngram_heads()
    }
    /// `N - 1`: tokens of history carried per sequence.
    pub fn context_len(&self) -> usize {
        self.dims.context_len()
    }
    /// E = ngram_heads * head_dim: the width of the gathered embedding.
    pub fn emb_dim(&self) -> usize {
        self.ngram_heads() * self.head_dim
    }
    /// C = hc * H: the channels of the gate and the conv.
    pub fn channels(&self) -> usize {
        self.hc_mult * self.hidden
    }
    /// Rows of conv state carried: `(kernel - 1) * dilation` with a conv,
    /// 0 without one.
    pub fn state_len(&self) -> usize {
        if !self.combine.has_conv() {
            return 0;
        }
        self.kernel.saturating_sub(1) * self.dilation
    }
    /// Bytes of the conv state: `state_len * C` f32 values.
    pub fn conv_bytes(&self) -> usize {
        self.state_len() * self.channels() * 4
    }
    /// Bytes of a well-formed aux blob of a sequence that has run: the
    /// history holds exactly `context_len` tokens.
    pub fn aux_blob_len(&self) -> usize {
        carry_blob::blob_len(self.context_len(), self.conv_bytes())
    }
    /// Bytes of device memory one sequence's carry holds at this site.
    pub fn carry_bytes(&self) -> usize {
        self.conv_bytes()
    }

    /// Check what a layer needs beyond a parsed config: usable hash
    /// constants, positive widths, `hc_mult` in `1..=MAX_HC_MULT`, a
    /// combination that goes with the hash family (the mean for LongCat,
    /// with one stream; gated otherwise), with a conv a kernel of at least 2
    /// and a dilation of at least 1, finite non-negative epsilons, and sizes
    /// that fit an allocation.
    pub fn validate(&self) -> Result<(), SpecError> {
        let bad = |field: &'static str, problem: String| Err(SpecError::Site { field, problem });
        if self.family != self.dims.family {
            return bad(
                "family",
                format!(
                    "{} differs from the hash constants' family {}",
                    self.family.name(),
                    self.dims.family.name()
                ),
            );
        }
        validate_family(&self.family, &self.dims)?;
        if self.head_dim == 0 {
            return bad("head_dim", "must be positive".into());
        }
        if self.hidden == 0 {
            return bad("hidden", "must be positive".into());
        }
        if !(1..=MAX_HC_MULT).contains(&self.hc_mult) {
            return bad(
                "hc_mult",
                format!("= {} is outside 1..={MAX_HC_MULT}", self.hc_mult),
            );
        }
        self.combine.check_site(&self.family, self.hc_mult)?;
        if self.combine.has_conv() {
            if self.kernel < 2 {
                return bad(
                    "conv kernel size",
                    format!("must be at least 2, got {}", self.kernel),
                );
            }
            if self.dilation < 1 {
                return bad(
                    "conv dilation",
                    format!("must be at least 1, got {}", self.dilation),
                );
            }
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return bad(
                "rms eps",
                format!("must be finite and >= 0, got {}", self.rms_eps),
            );
        }
        const LIMIT: usize = isize::MAX as usize;
        let sizes = self
            .ngram_heads()
            .checked_mul(self.head_dim)
            .and(self.hc_mult.checked_mul(self.hidden))
            .and_then(|c| {
                self.kernel
                    .saturating_sub(1)
                    .checked_mul(self.dilation)?
                    .checked_mul(c)
            })
            .and_then(|v| v.checked_mul(4))
            .and_then(|conv| carry_blob::checked_blob_len(self.context_len(), conv))
            .filter(|&v| v <= LIMIT);
        if sizes.is_none() {
            return bad(
                "geometry",
                "is too large to address (head_dim, hidden, hc_mult, kernel, dilation)".into(),
            );
        }
        Ok(())
    }

    /// A canonical byte encoding of everything that gives an aux blob its
    /// meaning: every field, fixed width, vectors with their lengths, so that
    /// two different sites never encode alike. The layer index and the eps
    /// are left out on purpose: a carry moves between sites of the same
    /// shape and constants. The family is encoded only for families other
    /// than Qwen4Exp, so fingerprints of existing snapshots stay valid.
    pub fn encode_canonical(&self, out: &mut Vec<u8>) {
        let d = &self.dims;
        for v in [d.ngram_size, d.heads_per_ngram] {
            out.extend_from_slice(&(v as u64).to_le_bytes());
        }
        for list in [&d.multipliers, &d.head_vocab_sizes, &d.head_offsets] {
            out.extend_from_slice(&(list.len() as u64).to_le_bytes());
            for v in list.iter() {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out.extend_from_slice(&d.eos_token_id.to_le_bytes());
        for v in [
            self.head_dim,
            self.hidden,
            self.hc_mult,
            self.kernel,
            self.dilation,
            self.state_len(),
        ] {
            out.extend_from_slice(&(v as u64).to_le_bytes());
        }
        self.family.encode_canonical(out);
        self.combine.encode_site(out);
    }
}
