//! [`Combine`]: how a site turns its gathered rows into what it adds to the
//! highway, the part of the layer math that differs by family
//! (docs/SPEC.md §5 (Layer math) and §11 (Families)).
//!
//! - [`Combine::Gated`] (Qwen4Exp and Engram): a key per highway stream
//!   gates one shared value against that stream; the gated value goes
//!   through an optional dilated short conv and is added to the stream. The
//!   families differ only in the parameters of [`GatedSpec`]: the form of
//!   the norms, their epsilons, the projection biases and whether the conv
//!   exists, the gate's value at a dot product of exactly 0, and whether a
//!   per-token mask may shut the gate (DeepSeek-V4.1 only).
//! - [`Combine::Mean`] (LongCat, at the input): the projected rows are
//!   added to the word embedding the highway holds and the sum is divided by
//!   `1 + ngram_heads` (the word embedding and every sub-table count once).
//!
//! Invariants: [`GatedSpec::qwen4exp`] is exactly the Qwen4Exp layer of
//! §5, so a Qwen4Exp site computes what it did before the combination was
//! a parameter; a site without a conv carries no conv state.

use super::{HashFamily, SpecError};

/// How a grouped RMS norm applies its weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NormForm {
    /// `x * rsqrt(mean(x^2) + eps) * (1 + w)`: weights start at 0
    /// (Qwen4Exp).
    OnePlusWeight,
    /// `x * rsqrt(mean(x^2) + eps) * w`: weights start at 1 (Engram, as
    /// `torch.nn.RMSNorm`).
    Weight,
}

impl NormForm {
    /// The constant added to each weight: 1 or 0. Adding 0.0 leaves every
    /// weight as it is, so one kernel serves both forms.
    pub fn offset(self) -> f32 {
        match self {
            NormForm::OnePlusWeight => 1.0,
            NormForm::Weight => 0.0,
        }
    }

    /// The kernel argument that selects the form: 0 (`1 + w`) or 1 (`w`).
    pub fn code(self) -> u32 {
        match self {
            NormForm::OnePlusWeight => 0,
            NormForm::Weight => 1,
        }
    }

    fn name(self) -> &'static str {
        match self {
            NormForm::OnePlusWeight => "1+w",
            NormForm::Weight => "w",
        }
    }
}

/// What the gate gives when the normed dot product `g` is exactly zero:
/// the published layers write the signed square root two ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GateSign {
    /// `sigmoid(sign(g) * sqrt(max(|g|, 1e-6)))` with `sign(0) = 0`, so
    /// `g == 0` gives exactly 0.5 (Qwen4Exp, the Engram demo's
    /// `torch.sign`).
    ZeroIsHalf,
    /// `sigmoid(copysign(sqrt(max(|g|, 1e-6)), g))`: `g == +0` gives
    /// `sigmoid(1e-3)` and `g == -0` gives `sigmoid(-1e-3)` (DeepSeek-V4.1's
    /// `torch.copysign`).
    CopySign,
}

impl GateSign {
    /// The bit this rule adds to the gate kernels' `form` argument (bit 0 is
    /// the norm form): 0 for [`GateSign::ZeroIsHalf`], 2 for
    /// [`GateSign::CopySign`].
    pub fn form_bit(self) -> u32 {
        match self {
            GateSign::ZeroIsHalf => 0,
            GateSign::CopySign => 2,
        }
    }
}

/// The parameters of the gated combination (Qwen4Exp, Engram).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatedSpec {
    /// The form of all three norms (query, key, conv input).
    pub norm: NormForm,
    /// Epsilon of the query (highway) norm; `None`: the site's `rms_eps`.
    pub query_eps: Option<f32>,
    /// Epsilon of the key norm; `None`: the site's `rms_eps`.
    pub key_eps: Option<f32>,
    /// Epsilon of the conv-input norm; `None`: the site's `rms_eps`.
    pub conv_eps: Option<f32>,
    /// Whether the key projection has a bias (`key_bias [C]`).
    pub key_bias: bool,
    /// Whether the value projection has a bias (`value_bias [H]`).
    pub value_bias: bool,
    /// Whether the short conv runs (`out = v + silu(conv(norm(v)))`);
    /// without it `out = v` and the site carries no conv state.
    pub conv: bool,
    /// The gate's value at a zero dot product.
    pub sign: GateSign,
    /// Whether a per-token mask may shut the gate (DeepSeek-V4.1's
    /// `token_mask`); a site without it refuses a mask.
    pub token_mask: bool,
}

impl GatedSpec {
    /// The Qwen4Exp layer of docs/SPEC.md §5: `(1 + w)` norms, every eps the
    /// site's `rms_eps`, no biases, a conv.
    pub const fn qwen4exp() -> GatedSpec {
        GatedSpec {
            norm: NormForm::OnePlusWeight,
            query_eps: None,
            key_eps: None,
            conv_eps: None,
            key_bias: false,
            value_bias: false,
            conv: true,
            sign: GateSign::ZeroIsHalf,
            token_mask: false,
        }
    }

    /// The Engram demo's gated layer: `w` norms whose query and key
    /// epsilons are the f32 machine epsilon (`torch.nn.RMSNorm` without an
    /// eps uses its dtype's), biased key and value projections, a gate of
    /// 0.5 at a zero dot product, no mask, and, when `conv`, the short conv
    /// whose norm has eps `1e-5` (the demo's `ShortConv`).
    pub const fn engram(conv: bool) -> GatedSpec {
        GatedSpec {
            norm: NormForm::Weight,
            query_eps: Some(f32::EPSILON),
            key_eps: Some(f32::EPSILON),
            conv_eps: Some(ENGRAM_CONV_EPS),
            key_bias: true,
            value_bias: true,
            conv,
            sign: GateSign::ZeroIsHalf,
            token_mask: false,
        }
    }

    /// DeepSeek-V4.1's Engram gate as published (`DeepseekV41Engram`):
    /// [`Self::engram`]'s norms and biases, but the query and key norms use
    /// the site's `rms_eps` (`config.rms_norm_eps`), the signed square root
    /// is a `copysign` (so a zero dot product does not give 0.5), and a
    /// per-token mask shuts the gate of masked tokens. `conv` keeps the
    /// demo's short conv for a config that asks for one; the published
    /// layer has none, so nothing defines a mask there and such a site
    /// takes none.
    pub const fn deepseek_v41(conv: bool) -> GatedSpec {
        GatedSpec {
            query_eps: None,
            key_eps: None,
            sign: GateSign::CopySign,
            token_mask: !conv,
            ..GatedSpec::engram(conv)
        }
    }

    /// The gate kernels' `form` argument: the norm form (bit 0) and the
    /// zero-dot rule (bit 1).
    pub fn form_code(&self) -> u32 {
        self.norm.code() | self.sign.form_bit()
    }

    /// The three epsilons (query, key, conv) with `rms_eps` for the unset.
    pub fn eps(&self, rms_eps: f32) -> [f32; 3] {
        [self.query_eps, self.key_eps, self.conv_eps].map(|e| e.unwrap_or(rms_eps))
    }
}

/// The eps of the norm in front of Engram's short conv (the demo's
/// `ShortConv(norm_eps=1e-5)`).
pub const ENGRAM_CONV_EPS: f32 = 1e-5;

/// How a site combines its gathered rows with the highway.
///
/// A closed enum on purpose: the layer picks its kernels and their
/// per-element loops by variant. Which variant a model uses, and with
/// which parameters, is its family's decision (`Family::combine`, in the
/// family's module under `ple/family/`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Combine {
    /// A key per stream gates a shared value (Qwen4Exp, Engram).
    Gated(GatedSpec),
    /// `highway = (highway + value) / (1 + ngram_heads)`: the mean of the
    /// word embedding (in the highway) and the projected sub-table rows
    /// (LongCat). No key, gate, norm or conv; one stream.
    Mean,
}

impl Default for Combine {
    fn default() -> Self {
        Combine::Gated(GatedSpec::qwen4exp())
    }
}

impl Combine {
    /// The Qwen4Exp combination.
    pub const fn qwen4exp() -> Combine {
        Combine::Gated(GatedSpec::qwen4exp())
    }

    /// The gated parameters, or `None` for [`Combine::Mean`].
    pub fn gated(&self) -> Option<&GatedSpec> {
        match self {
            Combine::Gated(g) => Some(g),
            Combine::Mean => None,
        }
    }

    /// Whether the site runs the short conv (and so carries conv state).
    pub fn has_conv(&self) -> bool {
        self.gated().is_some_and(|g| g.conv)
    }

    /// Whether the site has a key projection and the three norms.
    pub fn has_key(&self) -> bool {
        self.gated().is_some()
    }

    /// Whether the site takes the mean with the word embedding.
    pub fn is_mean(&self) -> bool {
        matches!(self, Combine::Mean)
    }

    /// Check the combination against the rest of its site: it goes with the
    /// hash rule `family` (the mean where the rule takes it, with one
    /// stream; gated otherwise), and its epsilons are finite and
    /// non-negative.
    pub fn check_site(&self, family: &HashFamily, hc_mult: usize) -> Result<(), SpecError> {
        let bad = |field: &'static str, problem: String| Err(SpecError::Site { field, problem });
        if family.takes_mean() != self.is_mean() {
            return bad(
                "combine",
                format!(
                    "{self:?} does not go with the {} hash: LongCat sites take the mean \
                     with the word embedding, the others are gated",
                    family.name()
                ),
            );
        }
        match self {
            Combine::Mean if hc_mult != 1 => bad(
                "hc_mult",
                format!(
                    "= {hc_mult}, but a site that takes the mean with the word embedding has one \
                     stream"
                ),
            ),
            Combine::Mean => Ok(()),
            Combine::Gated(g) => {
                for (name, eps) in [
                    ("query norm eps", g.query_eps),
                    ("key norm eps", g.key_eps),
                    ("conv norm eps", g.conv_eps),
                ] {
                    if let Some(e) = eps.filter(|e| !(e.is_finite() && *e >= 0.0)) {
                        return bad(name, format!("must be finite and >= 0, got {e}"));
                    }
                }
                Ok(())
            }
        }
    }

    /// The combination in words, as `inspect` prints it.
    pub fn describe(&self) -> String {
        match self {
            Combine::Gated(g) => format!(
                "gated: a key per stream, {} norms{}{}",
                match g.norm {
                    NormForm::OnePlusWeight => "(1 + w)",
                    NormForm::Weight => "w",
                },
                match (g.key_bias, g.value_bias) {
                    (true, true) => ", key and value biases",
                    (true, false) => ", a key bias",
                    (false, true) => ", a value bias",
                    (false, false) => "",
                },
                if g.conv {
                    ", dilated short conv"
                } else {
                    ", no conv"
                }
            ),
            Combine::Mean => {
                "mean: (word embedding + projected sub-table rows) / (1 + sub-tables)".to_string()
            }
        }
    }

    /// Append the combination's part of a site's canonical encoding to
    /// `out`: [`Self::encode_canonical`], except nothing for the Qwen4Exp
    /// combination, so fingerprints of existing snapshots stay valid.
    pub fn encode_site(&self, out: &mut Vec<u8>) {
        if *self != Combine::qwen4exp() {
            self.encode_canonical(out);
        }
    }

    /// Append a canonical encoding (what changes a carry's meaning) to
    /// `out`: a tag and every parameter at fixed width.
    pub fn encode_canonical(&self, out: &mut Vec<u8>) {
        match self {
            Combine::Gated(g) => {
                out.extend_from_slice(b"gated");
                out.extend_from_slice(g.norm.name().as_bytes());
                for e in [g.query_eps, g.key_eps, g.conv_eps] {
                    out.extend_from_slice(&e.map_or(u32::MAX, f32::to_bits).to_le_bytes());
                }
                out.extend_from_slice(&[
                    u8::from(g.key_bias),
                    u8::from(g.value_bias),
                    u8::from(g.conv),
                ]);
                // Only the published V4.1 rules add bytes, so the encodings
                // of the sites that existed before them are unchanged.
                if g.sign == GateSign::CopySign {
                    out.extend_from_slice(b"copysign");
                }
                if g.token_mask {
                    out.extend_from_slice(b"mask");
                }
            }
            Combine::Mean => out.extend_from_slice(b"mean"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_and_encodings_differ() {
        assert_eq!(NormForm::OnePlusWeight.offset(), 1.0);
        assert_eq!(NormForm::Weight.offset(), 0.0);
        assert_eq!(Combine::default(), Combine::qwen4exp());
        let g = GatedSpec::qwen4exp();
        assert_eq!(g.eps(1e-6), [1e-6; 3]);
        assert_eq!(
            GatedSpec::engram(true).eps(1e-6),
            [f32::EPSILON, f32::EPSILON, 1e-5]
        );
        // V4.1 reads `rms_norm_eps` for both gate norms.
        assert_eq!(
            GatedSpec::deepseek_v41(false).eps(1e-20),
            [1e-20, 1e-20, 1e-5]
        );
        assert_eq!(GatedSpec::engram(false).form_code(), 1);
        assert_eq!(GatedSpec::deepseek_v41(false).form_code(), 3);
        assert_eq!(GatedSpec::qwen4exp().form_code(), 0);
        let enc = |c: Combine| {
            let mut v = Vec::new();
            c.encode_canonical(&mut v);
            v
        };
        let all = [
            enc(Combine::qwen4exp()),
            enc(Combine::Gated(GatedSpec::engram(true))),
            enc(Combine::Gated(GatedSpec::engram(false))),
            enc(Combine::Gated(GatedSpec::deepseek_v41(false))),
            enc(Combine::Mean),
        ];
        for i in 0..all.len() {
            for j in i + 1..all.len() {
                assert_ne!(all[i], all[j], "{i} and {j} encode alike");
            }
        }
        assert!(!Combine::Mean.has_conv() && !Combine::Mean.has_key());
        assert!(!Combine::Gated(GatedSpec::engram(false)).has_conv());
    }
}
