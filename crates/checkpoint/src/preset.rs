//! The synthetic model specs `metrale-ple init` writes.
//!
//! Invariant: every preset's [`ModelSpec`] passes [`ModelSpec::validate`]
//! and round-trips through `config.json` unchanged.

use metrale_model_layers::layers::ple::spec::ModelSpec;

/// The synthetic geometries `metrale-ple init` can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// Hidden 64, 4 streams, 4 heads of 16, two sites, a ~200k-row table
    /// per site: the model `metrale-ple run` uses by default, seconds to build.
    Tiny,
    /// Hidden 256, 4 streams, 8 heads of 32, one site, a ~2M-row table.
    Small,
    /// The Qwen4Exp geometry of docs/SPEC.md, "Geometry"; the table is cut to the
    /// rows asked for (ids folded into them).
    Flagship,
}

impl Preset {
    /// Parse `tiny`, `small` or `flagship`.
    pub fn parse(s: &str) -> Option<Preset> {
        match s {
            "tiny" => Some(Preset::Tiny),
            "small" => Some(Preset::Small),
            "flagship" => Some(Preset::Flagship),
            _ => None,
        }
    }

    /// The preset's name.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::Flagship => "flagship",
        }
    }

    /// Rows stored per site when `--table-rows` is not given: the full
    /// table for tiny and small, 2^20 rows (320 MiB in BF16) for flagship.
    pub fn default_table_rows(self) -> Option<u64> {
        match self {
            Preset::Tiny | Preset::Small => None,
            Preset::Flagship => Some(1 << 20),
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
                ple_layer_ids: vec![2, 4],
                hash_seed: 1234,
                num_hidden_layers: 4,
                table_rows: None,
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
            },
            Preset::Flagship => ModelSpec {
                vocab_size: 151_936,
                hidden_size: 2560,
                hc_mult: 4,
                rms_norm_eps: 1e-6,
                eos_token_id: 151_645,
                ngram_size: 3,
                heads_per_ngram: 8,
                head_dim: 160,
                ngram_vocab_size_base: 20_000_000,
                divisible_by: 128,
                split_ngram_parts: 8,
                conv_kernel_size: 4,
                ple_layer_ids: vec![2],
                hash_seed: 1234,
                num_hidden_layers: 4,
                table_rows: None,
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
        for p in [Preset::Tiny, Preset::Small, Preset::Flagship] {
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
                "hc_mult",
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
        assert_eq!(g.emb_dim(), 2560);
        assert_eq!(g.channels(), 10240);
        assert_eq!(g.state_len(), 9);
        assert_eq!(g.aux_blob_bytes(), 368_652);
        let site = g.site(0).unwrap();
        assert_eq!(site.aux_blob_len(), 368_652);
        assert_eq!(site.conv_bytes(), 368_640);
        assert_eq!(site.layer, 1);
    }

    #[test]
    fn eos_list_and_defaults() {
        let mut v: serde_json::Value =
            serde_json::from_str(&Preset::Tiny.spec().to_config_json()).unwrap();
        v["eos_token_id"] = serde_json::json!([7, 9]);
        v.as_object_mut().unwrap().remove("ple_hash_seed");
        v.as_object_mut().unwrap().remove("ple_head_dim");
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
            ("hc_mult", serde_json::json!(0), "`hc_mult`"),
            (
                "ple_layer_ids",
                serde_json::json!([4, 2]),
                "strictly increasing",
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
        v.as_object_mut().unwrap().remove("hidden_size");
        let e = ModelSpec::from_json_str(&v.to_string(), "c.json").unwrap_err();
        assert!(
            matches!(&e, SpecError::Missing { field, .. } if field == "hidden_size"),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("c.json") && msg.contains("`hidden_size`"),
            "{msg}"
        );
    }
}
