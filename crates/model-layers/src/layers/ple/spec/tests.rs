//! Tests of config parsing, validation and site derivation.

use super::*;

const FLAGSHIP: &str = r#"{
    "architectures": ["Qwen4ExpForCausalLM"],
    "vocab_size": 151936, "hidden_size": 2560, "hc_mult": 4,
    "rms_norm_eps": 1e-6, "eos_token_id": [151645, 151643],
    "ngram_size": 3, "heads_per_ngram": 8, "ngram_vocab_size_base": 20000000,
    "split_ngram_parts": 16, "ple_conv_kernel_size": 4, "ple_layer_ids": [2]
}"#;

fn with(field: &str, value: &str) -> String {
    let mut v: Value = serde_json::from_str(FLAGSHIP).unwrap();
    if value == "DELETE" {
        v.as_object_mut().unwrap().remove(field);
    } else {
        v[field] = serde_json::from_str(value).unwrap();
    }
    v.to_string()
}

#[test]
fn flagship_with_defaults() {
    let c = ModelSpec::from_json_str(FLAGSHIP, "config.json").unwrap();
    assert_eq!(c.eos_token_id, 151_645);
    assert_eq!(c.divisible_by, 128);
    assert_eq!(c.hash_seed, 1234);
    assert_eq!(c.head_dim, 160);
    assert_eq!(c.ngram_heads(), 16);
    assert_eq!(c.num_hidden_layers, 2);
    let d = c.derive(0).unwrap();
    assert_eq!(d.padded_rows, 320_001_536);
    let e = crate::layers::ple::family::qwen4_exp::hash_params(&c, 1).unwrap_err();
    assert!(matches!(
        e,
        SpecError::NoSuchSite {
            site: 1,
            count: 1,
            ..
        }
    ));
    let e = e.to_string();
    assert!(e.contains("site 1") && e.contains("1 entries"), "{e}");
    let site = c.site(0).unwrap();
    assert_eq!(site.dims, d.dims);
    assert_eq!((site.layer, site.kernel, site.dilation), (1, 4, 3));
    assert_eq!(site.state_len(), 9);
    assert_eq!(site.aux_blob_len(), 368_652);
    site.validate().unwrap();
}

#[test]
fn eos_as_int_and_explicit_options() {
    let text = with("eos_token_id", "7");
    let c = ModelSpec::from_json_str(&text, "c.json").unwrap();
    assert_eq!(c.eos_token_id, 7);
    let mut v: Value = serde_json::from_str(FLAGSHIP).unwrap();
    v["ple_hash_seed"] = 99.into();
    v["make_ngram_vocab_size_divisible_by"] = 64.into();
    v["ple_head_dim"] = 128.into();
    let c = ModelSpec::from_json_str(&v.to_string(), "c.json").unwrap();
    assert_eq!((c.hash_seed, c.divisible_by, c.head_dim), (99, 64, 128));
}

#[test]
fn site_validation_names_the_field() {
    let spec = ModelSpec::from_json_str(FLAGSHIP, "c.json").unwrap();
    let base = spec.site(0).unwrap();
    type Edit = fn(&mut SiteSpec);
    let cases: [(&str, Edit); 6] = [
        ("hc_mult = 65 is outside", |s| s.hc_mult = 65),
        ("conv kernel size must be at least 2", |s| s.kernel = 1),
        ("conv dilation must be at least 1", |s| s.dilation = 0),
        ("rms eps", |s| s.rms_eps = f32::NAN),
        ("head_dim must be positive", |s| s.head_dim = 0),
        ("multipliers[0]", |s| s.dims.multipliers[0] = 2),
    ];
    for (want, f) in cases {
        let mut s = base.clone();
        f(&mut s);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
}

#[test]
fn errors_name_field_and_file() {
    let cases = [
        (
            "eos_token_id",
            "DELETE",
            "missing required field `eos_token_id`",
        ),
        (
            "ple_layer_ids",
            "null",
            "missing required field `ple_layer_ids`",
        ),
        ("vocab_size", "0", "`vocab_size` must be at least 1"),
        ("ngram_size", "1", "`ngram_size` must be at least 2"),
        (
            "ngram_size",
            "\"3\"",
            "`ngram_size` must be a non-negative integer",
        ),
        (
            "heads_per_ngram",
            "-1",
            "`heads_per_ngram` must be a non-negative integer",
        ),
        ("eos_token_id", "[]", "`eos_token_id` is an empty list"),
        ("eos_token_id", "[\"x\"]", "`eos_token_id[0]` must be"),
        ("eos_token_id", "4294967296", "does not fit a u32"),
        (
            "rms_norm_eps",
            "0",
            "`rms_norm_eps` must be a positive number",
        ),
        ("ple_layer_ids", "[]", "`ple_layer_ids` is empty"),
        (
            "ple_layer_ids",
            "[2, 0]",
            "`ple_layer_ids[1]` must be at least 1",
        ),
        ("ple_layer_ids", "2", "must be a list"),
        (
            "hidden_size",
            "2561",
            "is not a multiple of the 16 n-gram heads",
        ),
        (
            "make_ngram_vocab_size_divisible_by",
            "0",
            "must be at least 1",
        ),
    ];
    for (field, value, want) in cases {
        let e = ModelSpec::from_json_str(&with(field, value), "model/config.json").unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains(want), "{field}={value}: {msg}");
        assert!(msg.contains("model/config.json"), "{msg}");
    }
    let e = ModelSpec::from_json_str("[1]", "a.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("a.json") && e.contains("JSON object"), "{e}");
    let e = format!("{:#}", ModelSpec::from_json_str("{", "b.json").unwrap_err());
    assert!(e.contains("b.json: not valid JSON"), "{e}");
    let e = ModelSpec::from_file(Path::new("/nonexistent/c.json")).unwrap_err();
    assert!(matches!(e, SpecError::Read { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/c.json"), "{e}");
}

/// The config of a fixture of `fixtures/families/`.
fn family_config(name: &str) -> ModelSpec {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/families")
        .join(name);
    let doc: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    ModelSpec::from_json_str(&doc["config"].to_string(), name).unwrap()
}

#[test]
fn each_family_derives_its_combination() {
    let q = ModelSpec::from_json_str(FLAGSHIP, "config.json").unwrap();
    assert_eq!(q.combine(), Combine::qwen4exp());
    assert_eq!(q.site(0).unwrap().combine, Combine::qwen4exp());

    // The demo's short conv (kernel 4, dilation max_ngram_size).
    let demo = family_config("engram_demo.json");
    let s = demo.site(0).unwrap();
    assert_eq!(s.combine, Combine::Gated(GatedSpec::engram(true)));
    assert_eq!((s.kernel, s.dilation), (4, 3));
    assert_eq!(s.state_len(), 9);
    s.validate().unwrap();

    // DeepSeek-V4.1: no conv, so no conv state and a history-only blob.
    let v41 = family_config("deepseek_v41.json");
    let s = v41.site(1).unwrap();
    // The published V4.1 gate: `rms_norm_eps` in its norms, copysign, a mask.
    assert_eq!(s.combine, Combine::Gated(GatedSpec::deepseek_v41(false)));
    let g = *s.combine.gated().unwrap();
    assert_eq!(g.eps(s.rms_eps)[..2], [v41.rms_norm_eps as f32; 2]);
    assert!(g.token_mask);
    assert_eq!((s.state_len(), s.conv_bytes(), s.carry_bytes()), (0, 0, 0));
    assert_eq!(s.aux_blob_len(), 4 + 4 * 3);
    assert_eq!(v41.aux_blob_bytes(), s.aux_blob_len());
    s.validate().unwrap();

    // LongCat: the mean with the word embedding, one stream.
    let lc = family_config("longcat_flash_lite.json");
    let s = lc.site(0).unwrap();
    assert_eq!(s.combine, Combine::Mean);
    assert_eq!(s.emb_dim(), s.hidden);
    assert_eq!((s.state_len(), s.aux_blob_len()), (0, 4 + 4 * 3));
    s.validate().unwrap();
    let mut bad = s.clone();
    bad.combine = Combine::qwen4exp();
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("combine"), "{e}");
    let mut bad = s.clone();
    bad.hc_mult = 2;
    assert!(bad.validate().unwrap_err().to_string().contains("hc_mult"));
    let mut bad = s;
    bad.family = HashFamily::Qwen4Exp;
    assert!(bad.validate().unwrap_err().to_string().contains("family"));
}

#[test]
fn each_site_is_named_by_its_family() {
    let q = ModelSpec::from_json_str(FLAGSHIP, "config.json").unwrap();
    let specs = [
        q,
        family_config("engram_demo.json"),
        family_config("deepseek_v41.json"),
        family_config("longcat_flash_lite.json"),
    ];
    let names: Vec<&str> = specs
        .iter()
        .map(|spec| {
            let name = spec.site(0).unwrap().published_layer();
            assert_eq!(name, spec.family.desc().title);
            name
        })
        .collect();
    assert_eq!(
        names,
        [
            "Qwen4-Exp",
            "Engram demo",
            "DeepSeek-V4.1 Engram",
            "LongCat"
        ]
    );

    // V4.1's gate with this project's conv is not the published layer.
    let mut s = specs[2].site(0).unwrap();
    s.combine = Combine::Gated(GatedSpec::deepseek_v41(true));
    assert_eq!(
        s.published_layer(),
        "DeepSeek-V4.1 Engram with a short conv"
    );
    // An Engram site with any other gate follows the demo; a site built by
    // hand is named by its hash rule's family.
    s.combine = Combine::qwen4exp();
    assert_eq!(s.published_layer(), "Engram demo");
    let hand = SiteSpec::new(specs[0].site(0).unwrap().dims, 8, 16, 2, 4, 3);
    assert_eq!(hand.published_layer(), "Qwen4-Exp");
}

#[test]
fn a_site_fingerprint_names_its_combination() {
    let demo = family_config("engram_demo.json");
    let s = demo.site(0).unwrap();
    let mut a = Vec::new();
    s.encode_canonical(&mut a);
    let mut other = s.clone();
    other.combine = Combine::Gated(GatedSpec {
        key_bias: false,
        ..GatedSpec::engram(true)
    });
    let mut b = Vec::new();
    other.encode_canonical(&mut b);
    assert_ne!(a, b);
}

/// A config as transformers' `Qwen4ExpTextConfig.save_pretrained` writes it
/// (the PLE keys and the ones around them).
const TRANSFORMERS: &str = r#"{
    "architectures": ["Qwen4ExpForCausalLM"], "model_type": "qwen4_exp_text",
    "vocab_size": 4096, "hidden_size": 64, "hc_count": 4, "rms_norm_eps": 1e-6,
    "eos_token_id": 2, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
    "ngram_size": 3, "heads_per_ngram": 2, "ple_embed_dim": 64, "ngram_vocab_size_base": 50000,
    "make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": 2,
    "ple_conv_kernel_size": 4, "ple_layer_ids": [2, 3], "seed": 99
}"#;

fn edit(base: &str, f: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(base).unwrap();
    f(&mut v);
    v.to_string()
}

#[test]
fn transformers_keys_are_read() {
    let c = ModelSpec::from_json_str(TRANSFORMERS, "c.json").unwrap();
    assert_eq!((c.hc_mult, c.hash_seed, c.head_dim), (4, 99, 16));
    assert_eq!(
        (c.ple_layer_ids.clone(), c.num_hidden_layers),
        (vec![2, 3], 4)
    );
    // The seed reaches the multipliers: 99 and 1234 hash differently.
    let other = edit(TRANSFORMERS, |v| v["seed"] = 1234.into());
    let o = ModelSpec::from_json_str(&other, "c.json").unwrap();
    assert_ne!(
        c.derive(0).unwrap().dims.multipliers,
        o.derive(0).unwrap().dims.multipliers
    );
    // Each site pads its own table (transformers: 200,192 and 200,320 rows).
    assert_eq!(c.derive(0).unwrap().padded_rows, 200_192);
    assert_eq!(c.derive(1).unwrap().padded_rows, 200_320);
    // ple_embed_dim is the total width.
    let wide = edit(TRANSFORMERS, |v| v["ple_embed_dim"] = 128.into());
    assert_eq!(
        ModelSpec::from_json_str(&wide, "c.json").unwrap().head_dim,
        32
    );
    // The config round-trips through the writer.
    let back = ModelSpec::from_json_str(&c.to_config_json(), "back.json").unwrap();
    assert_eq!(back, c);
}

#[test]
fn transformers_defaults_fill_absent_keys() {
    let v = r#"{"model_type": "qwen4_exp_text", "eos_token_id": [248044, 248046],
        "ple_layer_ids": [3, 1, 3]}"#;
    let c = ModelSpec::from_json_str(v, "c.json").unwrap();
    assert_eq!(c.vocab_size, 248_320);
    assert_eq!(
        (c.hidden_size, c.hc_mult, c.ngram_size, c.heads_per_ngram),
        (2048, 4, 3, 8)
    );
    assert_eq!(
        (c.ngram_vocab_size_base, c.split_ngram_parts),
        (20_000_000, 512)
    );
    assert_eq!(
        (c.hash_seed, c.head_dim, c.num_hidden_layers),
        (1234, 128, 40)
    );
    // Sorted and deduplicated, as transformers does.
    assert_eq!(c.ple_layer_ids, vec![1, 3]);
    assert_eq!(c.eos_token_id, 248_044);
}

#[test]
fn multimodal_configs_nest_the_text_keys() {
    let inner: Value = serde_json::from_str(TRANSFORMERS).unwrap();
    let outer = serde_json::json!({
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp", "text_config": inner, "vision_config": {"depth": 2},
    });
    let c = ModelSpec::from_json_str(&outer.to_string(), "c.json").unwrap();
    assert_eq!(c, ModelSpec::from_json_str(TRANSFORMERS, "c.json").unwrap());
}

#[test]
fn keys_that_change_the_math_are_never_ignored() {
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: [(&str, Edit, &str); 6] = [
        (
            "old and new seed disagree",
            Box::new(|v| v["ple_hash_seed"] = 7.into()),
            "`seed` = 99, but the older key `ple_hash_seed` says 7",
        ),
        (
            "old and new stream count disagree",
            Box::new(|v| v["hc_mult"] = 2.into()),
            "`hc_count` = 4, but the older key `hc_mult` says 2",
        ),
        (
            "old head width disagrees",
            Box::new(|v| v["ple_head_dim"] = 8.into()),
            "`ple_embed_dim` = 64, but the older key `ple_head_dim` = 8",
        ),
        (
            "width not divisible",
            Box::new(|v| v["ple_embed_dim"] = 66.into()),
            "ple_embed_dim = 66 is not a multiple of the 4 n-gram heads",
        ),
        (
            "PLE on an attention layer",
            Box::new(|v| v["ple_layer_ids"] = serde_json::json!([2, 4])),
            "`ple_layer_ids[1]` = 4 is a `indexed_attention` layer",
        ),
        (
            "seed not an integer",
            Box::new(|v| v["seed"] = "99".into()),
            "`seed` must be a non-negative integer",
        ),
    ];
    for (what, f, want) in cases {
        let text = edit(TRANSFORMERS, |v| f(v));
        let e = format!(
            "{:#}",
            ModelSpec::from_json_str(&text, "m/config.json").unwrap_err()
        );
        assert!(
            e.contains(want) && e.contains("m/config.json"),
            "{what}: {e}"
        );
    }
    // Without layer_types, a transformers config takes the default pattern
    // (every fourth layer is attention).
    let text = edit(TRANSFORMERS, |v| {
        v.as_object_mut().unwrap().remove("layer_types");
        v["ple_layer_ids"] = serde_json::json!([4]);
    });
    let e = ModelSpec::from_json_str(&text, "c.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("is a `indexed_attention` layer"), "{e}");
}

/// Released DeepSeek-V4.1 and LongCat configs as the serving engines read
/// them: the pad's two spellings, a repack's extra `engram_*` key, the
/// seed no engine reads, and `use_oe_embedding`.
#[test]
fn released_engram_and_longcat_keys() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/families/deepseek_v41.json");
    let doc: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let base = doc["config"].clone();
    let parse = |v: &Value| ModelSpec::from_json_str(&v.to_string(), "c.json");
    let want = parse(&base).unwrap();
    // transformers' spelling of the pad.
    let mut v = base.clone();
    let pad = v["engram_pad_token_id"].clone();
    v.as_object_mut().unwrap().remove("engram_pad_token_id");
    v["engram_pad_id"] = pad.clone();
    assert_eq!(parse(&v).unwrap(), want);
    v["engram_pad_token_id"] = (pad.as_u64().unwrap() + 1).into();
    let e = parse(&v).unwrap_err().to_string();
    assert!(e.contains("`engram_pad_id` says"), "{e}");
    // A quantised repack's top-level key names no family: text_config is read.
    let nested = serde_json::json!({
        "model_type": "deepseek_v41", "engram_rotation_config": {"x": 1}, "text_config": base,
    });
    assert_eq!(parse(&nested).unwrap(), want);
    // No engine reads a seed.
    let mut v = base.clone();
    v["engram_seed"] = 5.into();
    let e = parse(&v).unwrap_err().to_string();
    assert!(
        e.contains("`engram_seed` = 5") && e.contains("seed 0"),
        "{e}"
    );
    v["engram_seed"] = 0.into();
    assert_eq!(parse(&v).unwrap(), want);

    let oe = serde_json::json!({
        "vocab_size": 1000, "hidden_size": 64, "eos_token_id": 2,
        "oe_vocab_size_ratio": 3, "oe_neighbor_num": 3, "oe_split_num": 2,
    });
    assert!(parse(&oe).is_ok());
    let mut v = oe.clone();
    v["use_oe_embedding"] = false.into();
    let e = parse(&v).unwrap_err().to_string();
    assert!(e.contains("`use_oe_embedding` is false"), "{e}");
    v["use_oe_embedding"] = 0.into();
    let e = parse(&v).unwrap_err().to_string();
    assert!(
        e.contains("`use_oe_embedding` must be true or false"),
        "{e}"
    );
}
