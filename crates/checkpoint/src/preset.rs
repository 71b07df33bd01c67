//! The synthetic model specs `metrale-ple init` writes, and the specs of
//! the Engram and LongCat families with their real hash constants.
//!
//! Invariant: every preset's [`ModelSpec`] passes [`ModelSpec::validate`]
//! and round-trips through `config.json` unchanged. The family presets
//! (`engram-demo`, `deepseek-v4.1`, `longcat-flash-lite`) have their
//! models' real configs (key names, widths, hash constants, logical table
//! sizes); `init` cuts their tables to the rows asked for.

use crate::backbone::Backbone;
use metrale_model_layers::layers::ple::family::ModelFamily;
use metrale_model_layers::layers::ple::family::engram::{EngramKeys, EngramSpec};
use metrale_model_layers::layers::ple::family::longcat::{LongCatKeys, LongCatSpec};
use metrale_model_layers::layers::ple::family::qwen4_exp::Qwen4Exp;
use metrale_model_layers::layers::ple::spec::ModelSpec;

/// The synthetic geometries `metrale-ple init` can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// Hidden 64, 4 streams, 4 heads of 16, two sites, a ~200k-row table
    /// per site: the model `metrale-ple run` uses by default, seconds to build.
    Tiny,
    /// Hidden 256, 4 streams, 8 heads of 32, one site, a ~2M-row table.
    Small,
    /// transformers' `Qwen4ExpTextConfig` defaults (docs/SPEC.md §2
    /// (Geometry)): vocabulary 248,320, hidden 2048, 4 streams, 16 heads of
    /// 128, base 20,000,000, 512 parts, one site at layer 2 of 40; the
    /// table is cut to the rows asked for (ids folded into them).
    Flagship,
    /// The Engram demo (`engram_demo_v1.py`): DeepSeek-V3's 129,280-token
    /// vocabulary, orders 2 and 3 with bases 5 * 129,280, 8 heads of 64,
    /// blocks 1 and 15 of 30, pad 2, seed 0, hidden 1024, 4 branches.
    EngramDemo,
    /// DeepSeek-V4.1's Engram: orders 2..=4 over base 16,000,000, 8 heads of
    /// 256, blocks 1 and 14 of 40, compressed vocabulary 99,092, pad 2;
    /// the rebuilt table sizes equal `engram_num_embeddings`.
    DeepseekV41,
    /// LongCat-Flash-Lite's n-gram embedding: vocabulary 131,072, hidden
    /// 3072, ratio 78, 4 neighbours, 4 splits (12 sub-tables of 256), EOS 2.
    LongcatFlashLite,
}

/// The compressed vocabulary DeepSeek-V4.1 states for its 129,280-token
/// vocabulary. The demo computes its own from DeepSeek-V3's tokenizer,
/// which is not at hand; the two vocabularies have the same size, and this
/// value is taken for the demo too.
const DEEPSEEK_COMPRESSED_VOCAB: u64 = 99_092;

impl Preset {
    /// Every preset.
    pub const ALL: [Preset; 6] = [
        Preset::Tiny,
        Preset::Small,
        Preset::Flagship,
        Preset::EngramDemo,
        Preset::DeepseekV41,
        Preset::LongcatFlashLite,
    ];

    /// Parse a name given by [`Self::name`].
    pub fn parse(s: &str) -> Option<Preset> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The table element type `init` writes when none is asked for: the
    /// family's own, FP8 rows with a UE8M0 scale per 32 values for
    /// DeepSeek-V4.1, BF16 for the rest.
    pub fn default_dtype(self) -> crate::synth::TableDType {
        match self {
            Preset::DeepseekV41 => crate::synth::TableDType::Fp8Block,
            _ => crate::synth::TableDType::Bf16,
        }
    }

    /// The preset's name.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::Flagship => "flagship",
            Preset::EngramDemo => "engram-demo",
            Preset::DeepseekV41 => "deepseek-v4.1",
            Preset::LongcatFlashLite => "longcat-flash-lite",
        }
    }

    /// Rows stored per site when `--table-rows` is not given: the full
    /// table for tiny and small, 2^20 rows (320 MiB in BF16) for flagship.
    pub fn default_table_rows(self) -> Option<u64> {
        match self {
            Preset::Tiny | Preset::Small => None,
            Preset::Flagship
            | Preset::EngramDemo
            | Preset::DeepseekV41
            | Preset::LongcatFlashLite => Some(1 << 20),
        }
    }

    /// The rest of the model `init` writes beside the PLE sites so that
    /// transformers loads it whole: the small Qwen4-Exp presets. The
    /// flagship's backbone (80 B parameters) and the other families' are
    /// not written.
    pub fn backbone(self) -> Option<Backbone> {
        let tiny = Backbone {
            attention_heads: 2,
            kv_heads: 1,
            head_dim: 32,
            linear_key_heads: 2,
            linear_value_heads: 2,
            linear_key_dim: 16,
            linear_value_dim: 16,
            linear_conv_kernel: 4,
            experts: 4,
            experts_per_token: 2,
            moe_intermediate: 32,
            shared_intermediate: 32,
            hc_lowrank: 16,
            indexer_heads: 2,
            indexer_head_dim: 32,
            indexer_budget: 8,
            indexer_compress_ratio: 4,
        };
        match self {
            Preset::Tiny => Some(tiny),
            Preset::Small => Some(Backbone {
                attention_heads: 4,
                head_dim: 64,
                linear_value_heads: 4,
                linear_key_dim: 32,
                linear_value_dim: 32,
                moe_intermediate: 64,
                shared_intermediate: 64,
                hc_lowrank: 32,
                indexer_head_dim: 64,
                ..tiny
            }),
            _ => None,
        }
    }

    /// The preset's model spec, with the full table.
    pub fn spec(self) -> ModelSpec {
        match self {
            Preset::Tiny => ModelSpec {
                vocab_size: 4096,
                hidden_size: 64,
                hc_mult: 4,
                rms_norm_eps: 1e-6,
                eos_token_id: 256,
                ngram_size: 3,
                heads_per_ngram: 2,
                head_dim: 16,
                ngram_vocab_size_base: 50_000,
                divisible_by: 128,
                split_ngram_parts: 2,
                conv_kernel_size: 4,
                ple_layer_ids: vec![2, 3],
                hash_seed: 1234,
                num_hidden_layers: 4,
                table_rows: None,
                family: ModelFamily::new(Qwen4Exp),
            },
            Preset::Small => ModelSpec {
                vocab_size: 32_000,
                hidden_size: 256,
                hc_mult: 4,
                rms_norm_eps: 1e-6,
                eos_token_id: 2,
                ngram_size: 3,
                heads_per_ngram: 4,
                head_dim: 32,
                ngram_vocab_size_base: 250_000,
                divisible_by: 128,
                split_ngram_parts: 4,
                conv_kernel_size: 4,
                ple_layer_ids: vec![2],
                hash_seed: 1234,
                num_hidden_layers: 8,
                table_rows: None,
                family: ModelFamily::new(Qwen4Exp),
            },
            Preset::Flagship => ModelSpec {
                vocab_size: 248_320,
                hidden_size: 2048,
                hc_mult: 4,
                rms_norm_eps: 1e-6,
                eos_token_id: 248_044,
                ngram_size: 3,
                heads_per_ngram: 8,
                head_dim: 128,
                ngram_vocab_size_base: 20_000_000,
                divisible_by: 128,
                split_ngram_parts: 512,
                conv_kernel_size: 4,
                ple_layer_ids: vec![2],
                hash_seed: 1234,
                num_hidden_layers: 40,
                table_rows: None,
                family: ModelFamily::new(Qwen4Exp),
            },
            Preset::EngramDemo => ModelSpec {
                vocab_size: 129_280,
                hidden_size: 1024,
                hc_mult: 4,
                rms_norm_eps: 1e-6,
                eos_token_id: 1,
                ngram_size: 3,
                heads_per_ngram: 8,
                head_dim: 64,
                ngram_vocab_size_base: 5 * 129_280,
                divisible_by: 1,
                split_ngram_parts: 1,
                conv_kernel_size: 4,
                ple_layer_ids: vec![2, 16],
                hash_seed: 0,
                num_hidden_layers: 30,
                table_rows: None,
                family: ModelFamily::new(EngramSpec {
                    keys: EngramKeys::Demo,
                    vocab_bases: vec![5 * 129_280, 5 * 129_280],
                    compressed_vocab_size: DEEPSEEK_COMPRESSED_VOCAB,
                    pad_id: 2,
                    num_embeddings: None,
                    token_map: None,
                }),
            },
            Preset::DeepseekV41 => ModelSpec {
                vocab_size: 129_280,
                hidden_size: 5120,
                hc_mult: 4,
                rms_norm_eps: 1e-6,
                eos_token_id: 1,
                ngram_size: 4,
                heads_per_ngram: 8,
                head_dim: 256,
                ngram_vocab_size_base: 16_000_000,
                divisible_by: 1,
                split_ngram_parts: 1,
                conv_kernel_size: 1,
                ple_layer_ids: vec![2, 15],
                hash_seed: 0,
                num_hidden_layers: 40,
                table_rows: None,
                family: ModelFamily::new(EngramSpec {
                    keys: EngramKeys::V41,
                    vocab_bases: vec![16_000_000; 3],
                    compressed_vocab_size: DEEPSEEK_COMPRESSED_VOCAB,
                    pad_id: 2,
                    num_embeddings: Some(vec![384_006_168, 384_016_682]),
                    token_map: None,
                }),
            },
            Preset::LongcatFlashLite => ModelSpec {
                vocab_size: 131_072,
                hidden_size: 3072,
                hc_mult: 1,
                rms_norm_eps: 1e-5,
                eos_token_id: 2,
                ngram_size: 4,
                heads_per_ngram: 4,
                head_dim: 256,
                ngram_vocab_size_base: 78 * 131_072,
                divisible_by: 1,
                split_ngram_parts: 1,
                conv_kernel_size: 1,
                ple_layer_ids: vec![1],
                hash_seed: 0,
                num_hidden_layers: 1,
                table_rows: None,
                family: ModelFamily::new(LongCatSpec {
                    keys: LongCatKeys::Flash,
                }),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_model_layers::layers::ple::spec::SpecError;

    #[test]
    fn presets_round_trip_through_config_json() {
        for p in Preset::ALL {
            assert_eq!(Preset::parse(p.name()), Some(p));
            let mut g = p.spec();
            g.table_rows = p.default_table_rows();
            g.validate(p.name()).unwrap();
            let back = ModelSpec::from_json_str(&g.to_config_json(), "config.json").unwrap();
            assert_eq!(back, g, "{}", p.name());
        }
    }

    /// Found by the `config_json` fuzz target: a huge `hc_mult` passed the
    /// checks and overflowed in `channels()`.
    #[test]
    fn sizes_that_overflow_are_refused_by_name() {
        let base: serde_json::Value =
            serde_json::from_str(&Preset::Tiny.spec().to_config_json()).unwrap();
        for (field, value, want) in [
            (
                "hc_count",
                serde_json::json!(477_777_776_777_777_777u64),
                "hc_mult * hidden_size",
            ),
            (
                "hidden_size",
                serde_json::json!(u64::MAX / 2),
                "hc_mult * hidden_size",
            ),
            (
                "ple_conv_kernel_size",
                serde_json::json!(u64::MAX / 2),
                "ple_conv_kernel_size",
            ),
        ] {
            let mut v = base.clone();
            v[field] = value;
            v.as_object_mut()
                .unwrap()
                .insert("ple_head_dim".into(), serde_json::json!(16));
            let e = ModelSpec::from_json_str(&v.to_string(), "c.json").unwrap_err();
            assert!(matches!(e, SpecError::TooLarge { .. }), "{field}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains(want) && msg.contains("too large") && msg.contains("c.json"),
                "{field}: {msg}"
            );
        }
        let mut g = Preset::Tiny.spec();
        g.ngram_size = usize::MAX;
        let e = g.validate("tiny").unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
    }

    #[test]
    fn flagship_matches_the_spec() {
        let g = Preset::Flagship.spec();
        assert_eq!(g.ngram_heads(), 16);
        assert_eq!(g.emb_dim(), 2048);
        assert_eq!(g.channels(), 8192);
        assert_eq!(g.state_len(), 9);
        assert_eq!(g.aux_blob_bytes(), 294_924);
        let site = g.site(0).unwrap();
        assert_eq!(site.aux_blob_len(), 294_924);
        assert_eq!(site.conv_bytes(), 294_912);
        assert_eq!(site.layer, 1);
    }

    #[test]
    fn eos_list_and_defaults() {
        let mut v: serde_json::Value =
            serde_json::from_str(&Preset::Tiny.spec().to_config_json()).unwrap();
        v["eos_token_id"] = serde_json::json!([7, 9]);
        v.as_object_mut().unwrap().remove("seed");
        v.as_object_mut().unwrap().remove("ple_embed_dim");
        let g = ModelSpec::from_json_str(&v.to_string(), "c.json").unwrap();
        assert_eq!(g.eos_token_id, 7);
        assert_eq!(g.hash_seed, 1234);
        assert_eq!(g.head_dim, 16);
    }

    #[test]
    fn bad_configs_name_the_field() {
        let base: serde_json::Value =
            serde_json::from_str(&Preset::Tiny.spec().to_config_json()).unwrap();
        let cases: [(&str, serde_json::Value, &str); 4] = [
            ("hc_count", serde_json::json!(0), "`hc_count`"),
            (
                "ple_layer_ids",
                serde_json::json!([4, 2]),
                "is a `indexed_attention` layer",
            ),
            (
                "eos_token_id",
                serde_json::json!(5000),
                "`eos_token_id` = 5000",
            ),
            (
                "ple_table_rows",
                serde_json::json!(0),
                "`ple_table_rows` must be positive",
            ),
        ];
        for (field, val, want) in cases {
            let mut v = base.clone();
            v[field] = val;
            let e = ModelSpec::from_json_str(&v.to_string(), "dir/config.json").unwrap_err();
            assert!(matches!(e, SpecError::Field { .. }), "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains(want) && msg.contains("dir/config.json"),
                "{msg}"
            );
        }
        let mut v = base.clone();
        v.as_object_mut().unwrap().remove("eos_token_id");
        let e = ModelSpec::from_json_str(&v.to_string(), "c.json").unwrap_err();
        assert!(
            matches!(&e, SpecError::Missing { field, .. } if field == "eos_token_id"),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("c.json") && msg.contains("`eos_token_id`"),
            "{msg}"
        );
    }

    #[test]
    fn v41_rebuilds_engram_num_embeddings() {
        let g = Preset::DeepseekV41.spec();
        let e = g.family.get::<EngramSpec>().expect("an Engram spec");
        let stated = e.num_embeddings.clone().unwrap();
        for (s, &want) in stated.iter().enumerate() {
            let d = g.derive(s).unwrap();
            assert_eq!(d.dims.table_rows(), want, "layer {}", g.site_layer(s));
            assert_eq!(d.padded_rows, want);
            assert_eq!(d.dims.ngram_heads(), 24);
        }
        assert_eq!(g.site_layer(0), 1);
        assert_eq!(g.site_layer(1), 14);
        // A stated size that differs is refused, naming the field.
        let mut bad = g.clone();
        bad.family = ModelFamily::new(EngramSpec {
            num_embeddings: Some(vec![384_006_168, 1]),
            ..e.clone()
        });
        let e = bad.validate("v41").unwrap_err().to_string();
        assert!(e.contains("engram_num_embeddings[1]"), "{e}");
    }

    #[test]
    fn family_presets_have_real_constants_and_valid_sites() {
        let demo = Preset::EngramDemo.spec();
        let d = demo.derive(0).unwrap();
        assert_eq!(d.dims.head_vocab_sizes[..3], [646_403, 646_411, 646_421]);
        assert_eq!(
            d.dims.multipliers,
            [76_632_096_046_245, 4_839_876_093_313, 35_959_672_319_349]
        );
        let lite = Preset::LongcatFlashLite.spec();
        let d = lite.derive(0).unwrap();
        assert!(d.dims.multipliers.is_empty());
        assert_eq!(d.dims.head_vocab_sizes.len(), 12);
        assert_eq!(d.dims.head_vocab_sizes[11], 78 * 131_072 + 23);
        assert_eq!(lite.head_dim, 256);
        for p in Preset::ALL {
            for s in 0..p.spec().sites() {
                p.spec().site(s).unwrap().validate().unwrap();
            }
        }
    }
}
