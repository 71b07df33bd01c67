//! A family defined outside the crate joins through the public registry
//! alone: a toy copy of LongCat, named by its own key
//! (`toy_vocab_size_ratio`), parses, derives and hashes exactly as the
//! LongCat config it mirrors, and the registry refuses a second family
//! with its id or a config naming two families at once.

use metrale_model_layers::layers::ple::family::{
    self, Family, FamilyDesc, ModelFamily, RegisterError, derive_dims, same,
};
use metrale_model_layers::layers::ple::ids::{DerivedPleIds, PleIdHasher, longcat_layout};
use metrale_model_layers::layers::ple::spec::{Combine, Fields, HashFamily, ModelSpec, SpecError};
use serde_json::{Value, json};

const KEY: &str = "toy_vocab_size_ratio";

static TOY: FamilyDesc = FamilyDesc {
    id: "toy",
    name: "toy",
    title: "Toy",
    detect: Some(|f| Ok(f.has(KEY).then_some(KEY))),
    parse,
    // Its sites are LongCat's, which LongCat's entry names.
    site_layer: |_| None,
};

#[derive(Clone, Debug, PartialEq)]
struct Toy;

impl Family for Toy {
    fn desc(&self) -> &'static FamilyDesc {
        &TOY
    }
    fn validate(&self, spec: &ModelSpec, source: &str) -> Result<(), SpecError> {
        longcat_layout(spec.ngram_vocab_size_base, spec.ngram_heads())
            .map(|_| ())
            .map_err(|e| SpecError::Field {
                file: source.into(),
                field: KEY.into(),
                problem: e.to_string(),
            })
    }
    fn derive(&self, spec: &ModelSpec, s: usize) -> Result<DerivedPleIds, SpecError> {
        let (sizes, _, _) = longcat_layout(spec.ngram_vocab_size_base, spec.ngram_heads())
            .map_err(|e| spec.derive_error(s, e))?;
        derive_dims(spec, s, Vec::new(), sizes, spec.eos_token_id)
    }
    fn hash_family(&self, spec: &ModelSpec) -> HashFamily {
        HashFamily::LongCat {
            vocab_size: spec.vocab_size,
        }
    }
    fn combine(&self, _spec: &ModelSpec) -> Combine {
        Combine::Mean
    }
    fn to_json(&self, spec: &ModelSpec) -> Value {
        json!({
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "eos_token_id": spec.eos_token_id,
            "rms_norm_eps": spec.rms_norm_eps,
            KEY: spec.ngram_vocab_size_base / spec.vocab_size,
            "toy_n": spec.ngram_size,
            "toy_k": spec.heads_per_ngram,
        })
    }
    fn eq_family(&self, other: &dyn Family) -> bool {
        same(self, other)
    }
}

fn parse(f: &Fields) -> Result<ModelSpec, SpecError> {
    let vocab_size = f.vocab_size()?;
    let hidden_size = f.count("hidden_size", 1)?;
    let ngram_size = f.ngram_size("toy_n")?;
    let heads_per_ngram = f.count("toy_k", 1)?;
    let spec = ModelSpec {
        vocab_size,
        hidden_size,
        hc_mult: 1,
        rms_norm_eps: f.eps_or("rms_norm_eps", 1e-5)?,
        eos_token_id: f.eos()?,
        ngram_size,
        heads_per_ngram,
        head_dim: hidden_size / ((ngram_size - 1) * heads_per_ngram),
        ngram_vocab_size_base: f.u64(KEY)? * vocab_size,
        divisible_by: 1,
        split_ngram_parts: 1,
        conv_kernel_size: 1,
        ple_layer_ids: vec![1],
        hash_seed: 0,
        num_hidden_layers: 1,
        table_rows: None,
        family: ModelFamily::new(Toy),
    };
    spec.validate(f.file)?;
    Ok(spec)
}

#[test]
fn a_registered_family_parses_derives_and_hashes() {
    // Registration is process-wide; this is the only test that registers.
    family::register(&TOY).unwrap();
    assert_eq!(
        family::register(&TOY),
        Err(RegisterError::DuplicateId("toy"))
    );
    assert!(family::find("toy").is_some());
    assert_eq!(family::families().len(), family::BUILTIN.len() + 1);

    let toy_cfg = r#"{"vocab_size": 100, "hidden_size": 24, "eos_token_id": 2,
        "toy_vocab_size_ratio": 3, "toy_n": 4, "toy_k": 2}"#;
    let cat_cfg = r#"{"vocab_size": 100, "hidden_size": 24, "eos_token_id": 2,
        "ngram_vocab_size_ratio": 3, "emb_neighbor_num": 4, "emb_split_num": 2}"#;
    let toy = ModelSpec::from_json_str(toy_cfg, "toy.json").unwrap();
    let cat = ModelSpec::from_json_str(cat_cfg, "cat.json").unwrap();
    assert_eq!(toy.family.name(), "toy");
    assert!(toy.family.get::<Toy>().is_some());
    assert_eq!(toy.combine(), Combine::Mean);
    let back = ModelSpec::from_json_str(&toy.to_config_json(), "back.json").unwrap();
    assert_eq!(back, toy);

    let (t, c) = (toy.derive(0).unwrap(), cat.derive(0).unwrap());
    assert_eq!(t.padded_rows, c.padded_rows);
    assert_eq!(t.dims, c.dims);
    let tokens: Vec<u32> = (0..64).map(|i| (i * 37 + 5) % 100).collect();
    let heads = t.dims.ngram_heads();
    let (mut a, mut b) = (vec![0; tokens.len() * heads], vec![0; tokens.len() * heads]);
    PleIdHasher::new(&t.dims)
        .unwrap()
        .ids_into(&tokens, &mut a)
        .unwrap();
    PleIdHasher::new(&c.dims)
        .unwrap()
        .ids_into(&tokens, &mut b)
        .unwrap();
    assert_eq!(a, b);

    // A config naming the toy and LongCat at once is refused.
    let both = r#"{"vocab_size": 100, "hidden_size": 24, "eos_token_id": 2,
        "toy_vocab_size_ratio": 3, "toy_n": 4, "toy_k": 2,
        "ngram_vocab_size_ratio": 3, "emb_neighbor_num": 4, "emb_split_num": 2}"#;
    let e = ModelSpec::from_json_str(both, "both.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains(KEY) && e.contains("LongCat"), "{e}");
}
