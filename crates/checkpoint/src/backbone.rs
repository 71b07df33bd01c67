//! The rest of a Qwen4-Exp model around its PLE sites, so that what
//! `metrale-ple init` writes for the small Qwen4-Exp presets loads in
//! transformers' `Qwen4ExpForCausalLM.from_pretrained` with no missing,
//! unexpected or mismatched key.
//!
//! The runtime never reads these tensors: they are synthetic (random
//! projections, norms at their starting values) and exist only to make the
//! checkpoint a whole model. Their names and shapes follow transformers'
//! `modeling_qwen4_exp.py` (gated delta-net and indexed-attention layers,
//! the sparse MoE with a shared expert, the hyper-connection mixers);
//! `crates/python/tests` loads an `init` checkpoint with transformers on
//! every CI run, so a drift fails there.
//!
//! Invariant: every key [`Backbone::config`] writes is one
//! `Qwen4ExpTextConfig` defines, and [`Backbone::tensors`] lists each
//! parameter of the model that is not under `.ple.` exactly once.

use metrale_model_layers::layers::ple::family::qwen4_exp::{
    INDEXED_ATTENTION, default_layer_types,
};
use metrale_model_layers::layers::ple::spec::ModelSpec;
use serde_json::{Value, json};

/// The backbone fields of a `Qwen4ExpTextConfig` (the PLE ones are the
/// [`ModelSpec`]'s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backbone {
    /// `num_attention_heads`.
    pub attention_heads: u64,
    /// `num_key_value_heads`.
    pub kv_heads: u64,
    /// `head_dim` of the attention layers.
    pub head_dim: u64,
    /// `linear_num_key_heads`.
    pub linear_key_heads: u64,
    /// `linear_num_value_heads`.
    pub linear_value_heads: u64,
    /// `linear_key_head_dim`.
    pub linear_key_dim: u64,
    /// `linear_value_head_dim`.
    pub linear_value_dim: u64,
    /// `linear_conv_kernel_dim`.
    pub linear_conv_kernel: u64,
    /// `num_experts`.
    pub experts: u64,
    /// `num_experts_per_tok`.
    pub experts_per_token: u64,
    /// `moe_intermediate_size`.
    pub moe_intermediate: u64,
    /// `shared_expert_intermediate_size`.
    pub shared_intermediate: u64,
    /// `hc_lowrank`.
    pub hc_lowrank: u64,
    /// `indexer_n_heads`.
    pub indexer_heads: u64,
    /// `indexer_head_dim`.
    pub indexer_head_dim: u64,
    /// `indexer_budget`.
    pub indexer_budget: u64,
    /// `indexer_compress_ratio`.
    pub indexer_compress_ratio: u64,
}

/// How a backbone tensor starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Small random values (a projection or an embedding).
    Random,
    /// All `v` (a `(1 + w)` norm at 0, a gated norm or `dt_bias` at 1).
    Constant(f32),
}

impl Backbone {
    /// The config keys of the backbone (merged into the PLE ones).
    pub fn config(&self) -> Value {
        json!({
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "num_attention_heads": self.attention_heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_key_heads,
            "linear_num_value_heads": self.linear_value_heads,
            "linear_key_head_dim": self.linear_key_dim,
            "linear_value_head_dim": self.linear_value_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel,
            "num_experts": self.experts,
            "num_experts_per_tok": self.experts_per_token,
            "moe_intermediate_size": self.moe_intermediate,
            "shared_expert_intermediate_size": self.shared_intermediate,
            "hc_lowrank": self.hc_lowrank,
            "indexer_n_heads": self.indexer_heads,
            "indexer_kv_heads": 1,
            "indexer_head_dim": self.indexer_head_dim,
            "indexer_budget": self.indexer_budget,
            "indexer_compress_ratio": self.indexer_compress_ratio,
            "dtype": "bfloat16",
        })
    }

    /// Every non-PLE parameter of the model `g` describes, with its shape
    /// and starting values, in a fixed order.
    pub fn tensors(&self, g: &ModelSpec) -> Vec<(String, Vec<u64>, Init)> {
        let h = g.hidden_size as u64;
        let v = g.vocab_size;
        let hc = g.hc_mult as u64;
        let c = hc * h;
        let zero = Init::Constant(0.0);
        let mut out: Vec<(String, Vec<u64>, Init)> = vec![
            ("lm_head.weight".into(), vec![v, h], Init::Random),
            ("model.embed_tokens.weight".into(), vec![v, h], Init::Random),
        ];
        let mixer = |out: &mut Vec<(String, Vec<u64>, Init)>, p: &str, inject: bool| {
            out.push((format!("{p}.hc_norm.weight"), vec![c], zero));
            out.push((
                format!("{p}.input_mix_weight_down.weight"),
                vec![self.hc_lowrank, c],
                Init::Random,
            ));
            out.push((
                format!("{p}.input_mix_weight_up.weight"),
                vec![c, self.hc_lowrank],
                Init::Random,
            ));
            if inject {
                out.push((
                    format!("{p}.block_inject_weight.weight"),
                    vec![hc, c],
                    Init::Random,
                ));
            }
        };
        mixer(&mut out, "model.hyper_connection_mixer", false);
        let types = default_layer_types(g.num_hidden_layers, 4);
        let ple: Vec<usize> = g.ple_layer_ids.iter().map(|l| l - 1).collect();
        for (l, t) in types.iter().enumerate() {
            let p = format!("model.layers.{l}");
            mixer(&mut out, &format!("{p}.attn_hyper_connection"), true);
            mixer(&mut out, &format!("{p}.mlp_hyper_connection"), true);
            // A PLE layer is always a linear one (the config says so too).
            if t == INDEXED_ATTENTION && !ple.contains(&l) {
                let (hd, q, kv) = (self.head_dim, self.attention_heads, self.kv_heads);
                let a = format!("{p}.self_attn");
                out.push((
                    format!("{a}.q_proj.weight"),
                    vec![2 * q * hd, h],
                    Init::Random,
                ));
                out.push((format!("{a}.k_proj.weight"), vec![kv * hd, h], Init::Random));
                out.push((format!("{a}.v_proj.weight"), vec![kv * hd, h], Init::Random));
                out.push((format!("{a}.o_proj.weight"), vec![h, q * hd], Init::Random));
                out.push((format!("{a}.q_norm.weight"), vec![hd], zero));
                out.push((format!("{a}.k_norm.weight"), vec![hd], zero));
                let ix = self.indexer_head_dim;
                out.push((
                    format!("{a}.indexer.index_qk_proj.weight"),
                    vec![(self.indexer_heads + 1) * ix, h],
                    Init::Random,
                ));
                out.push((format!("{a}.indexer.q_layernorm.weight"), vec![ix], zero));
                out.push((format!("{a}.indexer.k_layernorm.weight"), vec![ix], zero));
            } else {
                let a = format!("{p}.linear_attn");
                let key = self.linear_key_heads * self.linear_key_dim;
                let value = self.linear_value_heads * self.linear_value_dim;
                let conv = 2 * key + value;
                let vh = self.linear_value_heads;
                out.push((format!("{a}.A_log"), vec![vh], zero));
                out.push((format!("{a}.dt_bias"), vec![vh], Init::Constant(1.0)));
                out.push((
                    format!("{a}.conv1d.weight"),
                    vec![conv, 1, self.linear_conv_kernel],
                    Init::Random,
                ));
                out.push((
                    format!("{a}.in_proj_qkv.weight"),
                    vec![conv, h],
                    Init::Random,
                ));
                out.push((
                    format!("{a}.in_proj_z.weight"),
                    vec![value, h],
                    Init::Random,
                ));
                out.push((format!("{a}.in_proj_a.weight"), vec![vh, h], Init::Random));
                out.push((format!("{a}.in_proj_b.weight"), vec![vh, h], Init::Random));
                out.push((
                    format!("{a}.norm.weight"),
                    vec![self.linear_value_dim],
                    Init::Constant(1.0),
                ));
                out.push((format!("{a}.out_proj.weight"), vec![h, value], Init::Random));
            }
            let m = format!("{p}.mlp");
            out.push((
                format!("{m}.gate.weight"),
                vec![self.experts, h],
                Init::Random,
            ));
            for e in 0..self.experts {
                let x = format!("{m}.experts.{e}");
                let i = self.moe_intermediate;
                out.push((format!("{x}.gate_proj.weight"), vec![i, h], Init::Random));
                out.push((format!("{x}.up_proj.weight"), vec![i, h], Init::Random));
                out.push((format!("{x}.down_proj.weight"), vec![h, i], Init::Random));
            }
            let s = format!("{m}.shared_expert");
            let i = self.shared_intermediate;
            out.push((format!("{s}.gate_proj.weight"), vec![i, h], Init::Random));
            out.push((format!("{s}.up_proj.weight"), vec![i, h], Init::Random));
            out.push((format!("{s}.down_proj.weight"), vec![h, i], Init::Random));
            out.push((
                format!("{m}.shared_expert_gate.weight"),
                vec![1, h],
                Init::Random,
            ));
        }
        out
    }
}
