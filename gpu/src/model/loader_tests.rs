//! Loader tests: the real SmolLM2 GGUF file and a tiny Hugging Face checkpoint written here.

use safetensors::tensor::{Dtype as StDtype, TensorView as StView};

use super::*;
use crate::model::chat_template::ChatMessage;
use crate::model::config::RopeStyle;
use crate::model::fetch::test_model_path;
use crate::model::gguf::parse_header;
use crate::model::gguf::tests::GgufWriter;
use crate::model::tensor::DType;

#[test]
fn loads_smollm2_gguf() {
    let m = load_model(&test_model_path(), &crate::progress::NoProgress).unwrap();
    // Hyper-parameters published with SmolLM2-135M (issue 3).
    let c = &m.config;
    assert_eq!(
        (
            c.num_layers,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim
        ),
        (30, 576, 9, 3, 64)
    );
    assert_eq!((c.intermediate_size, c.vocab_size), (1536, 49152));
    assert_eq!(c.rope_theta, 100_000.0);
    assert_eq!(c.rope_style, RopeStyle::Interleaved);
    assert!(c.tie_word_embeddings && !m.weights.contains("output.weight"));
    assert_eq!(c.max_position_embeddings, 8192);
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    let emb = m.weights.get("token_embd.weight").unwrap();
    assert_eq!(
        (emb.dtype, emb.shape.clone()),
        (DType::Q8_0, vec![49152, 576])
    );
    let q = m.weights.get("blk.29.attn_q.weight").unwrap();
    assert_eq!((q.dtype, q.shape.clone()), (DType::Q4_1, vec![576, 576]));
    assert_eq!(
        m.weights.get("output_norm.weight").unwrap().dtype,
        DType::F32
    );
    let out = m
        .chat_template
        .as_ref()
        .unwrap()
        .render(&[ChatMessage::new("user", "hi")], true)
        .unwrap();
    assert!(out.starts_with("<|im_start|>system\n") && out.ends_with("<|im_start|>assistant\n"));
    assert_eq!(m.tokenizer.encode("<|im_end|>", false).unwrap(), vec![2]);
}

fn scratch(tag: &str) -> crate::scratch::ScratchDir {
    crate::scratch::ScratchDir::new(&format!("load-{tag}"))
}

/// Writes a 1-layer Llama checkpoint (hidden 4, 2 heads of 2, 1 KV head, FFN 8, vocab 10)
/// with `q_rows` rows in the q projection (4 is correct).
fn write_tiny_hf(dir: &Path, q_rows: usize) {
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 8,
            "vocab_size": 10, "tie_word_embeddings": true, "bos_token_id": 0,
            "eos_token_id": 0, "rope_theta": 10000.0}"#,
    )
    .unwrap();
    let shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![10, 4]),
        ("model.norm.weight".into(), vec![4]),
        ("model.layers.0.input_layernorm.weight".into(), vec![4]),
        (
            "model.layers.0.self_attn.q_proj.weight".into(),
            vec![q_rows, 4],
        ),
        ("model.layers.0.self_attn.k_proj.weight".into(), vec![2, 4]),
        ("model.layers.0.self_attn.v_proj.weight".into(), vec![2, 4]),
        ("model.layers.0.self_attn.o_proj.weight".into(), vec![4, 4]),
        (
            "model.layers.0.post_attention_layernorm.weight".into(),
            vec![4],
        ),
        ("model.layers.0.mlp.gate_proj.weight".into(), vec![8, 4]),
        ("model.layers.0.mlp.up_proj.weight".into(), vec![8, 4]),
        ("model.layers.0.mlp.down_proj.weight".into(), vec![4, 8]),
    ];
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .map(|(_, s)| vec![0u8; 2 * s.iter().product::<usize>()])
        .collect();
    let views: Vec<(String, StView<'_>)> = shapes
        .iter()
        .zip(&data)
        .map(|((n, s), d)| (n.clone(), StView::new(StDtype::BF16, s.clone(), d).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    // A tokenizer.json made from a tiny byte-level BPE vocabulary.
    let mut w = GgufWriter::default();
    w.string("tokenizer.ggml.model", "gpt2")
        .string("tokenizer.ggml.pre", "smollm")
        .str_array("tokenizer.ggml.tokens", &["<s>", "a", "b", "ab", "1", "2"])
        .i32_array("tokenizer.ggml.token_type", &[3, 1, 1, 1, 1, 1])
        .str_array("tokenizer.ggml.merges", &["a b"]);
    let h = parse_header(&w.build(), Path::new("t")).unwrap();
    let json = Tokenizer::from_gguf(&h).unwrap().to_json().unwrap();
    std::fs::write(dir.join("tokenizer.json"), json).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"}"#,
    )
    .unwrap();
}

#[test]
fn loads_tiny_hf_checkpoint() {
    let d = scratch("hf");
    write_tiny_hf(&d, 4);
    let sink = crate::progress::Recorded::default();
    let m = load_model(&d, &sink).unwrap();
    // The checks count the model's tensors, one at a time to the end: the embedding and the
    // final norm (the output tied to the embedding) and 9 for its one layer, 11.
    let mut want = vec!["step loading model 11 tensors".to_string()];
    want.extend((1..=11).map(|i| format!("at {i}")));
    want.push("done".into());
    assert_eq!(sink.told(), want);
    assert_eq!(m.config.rope_style, RopeStyle::Halves);
    assert_eq!(m.config.head_dim, 2);
    assert_eq!(
        m.weights.get("blk.0.ffn_down.weight").unwrap().shape,
        vec![4, 8]
    );
    assert_eq!(
        m.weights.get("blk.0.attn_q.weight").unwrap().dtype,
        DType::BF16
    );
    assert_eq!(
        m.tokenizer.encode("ab12<s>", false).unwrap(),
        vec![3, 4, 5, 0]
    );
    assert_eq!(m.tokenizer.eos_token_ids(), &[0]);
    let t = m.chat_template.unwrap();
    assert_eq!(
        t.render(&[ChatMessage::new("user", "x")], false).unwrap(),
        "<s>x"
    );
}

#[test]
fn generation_config_end_ids_join_the_configs() {
    let d = scratch("gen-eos");
    write_tiny_hf(&d, 4);
    std::fs::write(
        d.join("generation_config.json"),
        r#"{"eos_token_id": [5, 0]}"#,
    )
    .unwrap();
    let m = load_model(&d, &crate::progress::NoProgress).unwrap();
    assert_eq!(m.config.eos_token_ids, [0, 5]);
    assert_eq!(m.tokenizer.eos_token_ids(), &[0, 5]);
    // Ids outside the vocabulary, or not ids, are refused.
    for bad in [r#"{"eos_token_id": 10}"#, r#"{"eos_token_id": "x"}"#] {
        std::fs::write(d.join("generation_config.json"), bad).unwrap();
        assert!(
            load_model(&d, &crate::progress::NoProgress).is_err(),
            "{bad}"
        );
    }
}

#[test]
fn a_bias_or_head_norm_the_architecture_lacks_is_refused() {
    let d = scratch("bias");
    write_tiny_hf(&d, 4);
    // A Llama checkpoint with a q bias, an output projection's, or Qwen3's key norm: nothing
    // would apply them.
    let data = vec![0u8; 8];
    for (tensor, canonical) in [
        ("model.layers.0.self_attn.q_proj.bias", "blk.0.attn_q.bias"),
        (
            "model.layers.0.self_attn.o_proj.bias",
            "blk.0.attn_output.bias",
        ),
        (
            "model.layers.0.self_attn.k_norm.weight",
            "blk.0.attn_k_norm.weight",
        ),
    ] {
        let bias = StView::new(StDtype::BF16, vec![4], &data).unwrap();
        safetensors::serialize_to_file(
            vec![(tensor.to_string(), bias)],
            None,
            &d.join("model-bias.safetensors"),
        )
        .unwrap();
        let e = load_model(&d, &crate::progress::NoProgress)
            .unwrap_err()
            .to_string();
        assert!(e.contains(canonical), "{e}");
    }
}

#[test]
fn wrong_tensor_shape_names_the_tensor() {
    let d = scratch("shape");
    write_tiny_hf(&d, 6);
    let e = load_model(&d, &crate::progress::NoProgress)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.0.attn_q.weight") && e.contains("expected [4, 4]"),
        "{e}"
    );
}

#[test]
fn missing_tensor_and_missing_file_are_errors() {
    let d = scratch("missing");
    write_tiny_hf(&d, 4);
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    assert!(load_model(&d, &crate::progress::NoProgress)
        .unwrap_err()
        .to_string()
        .contains("tokenizer.json"));
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    assert!(load_model(&d, &crate::progress::NoProgress).is_err());
    assert!(
        load_model(&d.join("nope.gguf"), &crate::progress::NoProgress)
            .unwrap_err()
            .to_string()
            .contains("nope.gguf")
    );
    // A GGUF without the layer tensors.
    let mut w = GgufWriter::default();
    w.string("general.architecture", "llama")
        .u32("llama.block_count", 1)
        .u32("llama.embedding_length", 32)
        .u32("llama.attention.head_count", 2)
        .u32("llama.feed_forward_length", 64)
        .string("tokenizer.ggml.model", "gpt2")
        .string("tokenizer.ggml.pre", "gpt2")
        .str_array("tokenizer.ggml.tokens", &["a", "b"])
        .str_array("tokenizer.ggml.merges", &[])
        .tensor("token_embd.weight", &[32, 2], 0, vec![0u8; 256]);
    let p = d.join("m.gguf");
    std::fs::write(&p, w.build()).unwrap();
    let sink = crate::progress::Recorded::default();
    let e = load_model(&p, &sink).unwrap_err().to_string();
    assert!(
        e.contains("output_norm.weight") && e.contains("not found"),
        "{e}"
    );
    // The embedding was checked, then the failure: the step never says it is done.
    let told = sink.told();
    assert!(
        told.len() == 2 && told[0].starts_with("step loading model ") && told[1] == "at 1",
        "{told:?}"
    );
}

#[test]
fn loads_tiny_llama3_gguf_with_rope_freqs() {
    use crate::model::rope::{llama3_freq_factors, Llama3Scaling, RopeScaling};
    let (h, heads, kv, ff, vocab) = (128u64, 2u64, 1u64, 64u64, 4u64);
    let hd = h / heads;
    let zeros = |n: u64| vec![0u8; 4 * n as usize];
    let want = Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let freqs: Vec<u8> = llama3_freq_factors(&want, 500_000.0, hd as usize)
        .iter()
        .flat_map(|f| f.to_le_bytes())
        .collect();
    let mut w = GgufWriter::default();
    w.string("general.architecture", "llama")
        .string("general.name", "tiny-llama3")
        .u32("llama.block_count", 1)
        .u32("llama.embedding_length", h as u32)
        .u32("llama.attention.head_count", heads as u32)
        .u32("llama.attention.head_count_kv", kv as u32)
        .u32("llama.feed_forward_length", ff as u32)
        .f32("llama.rope.freq_base", 500_000.0)
        .string("tokenizer.ggml.model", "gpt2")
        .string("tokenizer.ggml.pre", "llama-bpe")
        .str_array("tokenizer.ggml.tokens", &["a", "b", "c", "d"])
        .str_array("tokenizer.ggml.merges", &[])
        .tensor("token_embd.weight", &[h, vocab], 0, zeros(h * vocab))
        .tensor("output.weight", &[h, vocab], 0, zeros(h * vocab))
        .tensor("output_norm.weight", &[h], 0, zeros(h))
        .tensor("blk.0.attn_norm.weight", &[h], 0, zeros(h))
        .tensor("blk.0.ffn_norm.weight", &[h], 0, zeros(h))
        .tensor("blk.0.attn_q.weight", &[h, h], 0, zeros(h * h))
        .tensor("blk.0.attn_k.weight", &[h, kv * hd], 0, zeros(h * kv * hd))
        .tensor("blk.0.attn_v.weight", &[h, kv * hd], 0, zeros(h * kv * hd))
        .tensor("blk.0.attn_output.weight", &[h, h], 0, zeros(h * h))
        .tensor("blk.0.ffn_gate.weight", &[h, ff], 0, zeros(h * ff))
        .tensor("blk.0.ffn_up.weight", &[h, ff], 0, zeros(h * ff))
        .tensor("blk.0.ffn_down.weight", &[ff, h], 0, zeros(h * ff));
    let base = w.clone();
    w.tensor("rope_freqs.weight", &[hd / 2], 0, freqs);
    let d = scratch("llama3");
    let p = d.join("tiny.gguf");
    std::fs::write(&p, w.build()).unwrap();
    // The directory holding a single GGUF file loads it too.
    assert_eq!(
        load_model(&d, &crate::progress::NoProgress).unwrap().name,
        "tiny-llama3"
    );
    std::fs::write(d.join("other.gguf"), b"").unwrap();
    let e = load_model(&d, &crate::progress::NoProgress)
        .unwrap_err()
        .to_string();
    assert!(e.contains("several .gguf"), "{e}");
    let m = load_model(&p, &crate::progress::NoProgress).unwrap();
    assert_eq!(m.name, "tiny-llama3");
    assert!(!m.config.tie_word_embeddings);
    let Some(RopeScaling::Llama3(s)) = m.config.rope_scaling else {
        panic!("{:?}", m.config.rope_scaling)
    };
    assert_eq!((s.factor, s.original_max_position_embeddings), (8.0, 8192));
    assert!((s.low_freq_factor - 1.0).abs() < 1e-3 && (s.high_freq_factor - 4.0).abs() < 1e-3);
    assert!(m.chat_template.is_none());
    // Scaling keys beside the tensor: two answers, refused.
    w.string("llama.rope.scaling.type", "linear")
        .f32("llama.rope.scaling.factor", 2.0);
    std::fs::write(&p, w.build()).unwrap();
    let e = load_model(&p, &crate::progress::NoProgress)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rope_freqs.weight"), "{e}");
    // A tensor of another length, or quantized, is refused before it is converted to f32
    // (Q2_K blocks would expand twelvefold first): 33 floats, 256 values of Q2_K (type 10,
    // one block of 84 bytes), 32 of Q8_0 (type 8, one block of 34 bytes).
    for (n, ggml_type, bytes) in [
        (hd / 2 + 1, 0, 4 * (hd / 2 + 1)),
        (256, 10, 84),
        (32, 8, 34),
    ] {
        let mut w = base.clone();
        w.tensor(
            "rope_freqs.weight",
            &[n],
            ggml_type,
            vec![0u8; bytes as usize],
        );
        std::fs::write(&p, w.build()).unwrap();
        let e = load_model(&p, &crate::progress::NoProgress)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rope_freqs.weight") && e.contains("need 32 floats"),
            "{n} of type {ggml_type}: {e}"
        );
    }
}

/// The engine moves a loaded model to the executor thread and shares the tokenizer and the
/// template between tokenizer workers.
#[test]
fn loaded_model_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<LoadedModel>();
    check::<Tokenizer>();
    check::<ChatTemplate>();
}

/// `check_model_path` (`config check`, `serve` before its load) accepts what `load_model`
/// reads and refuses, for the load's reason and with a few bytes read, a directory that holds
/// no model (serve then failed with "config.json: No such file" once it had started), a
/// checkpoint without its tokenizer or shards, and a file that is not GGUF.
#[test]
fn the_path_check_accepts_what_a_load_reads_and_refuses_the_rest() {
    let check = |p: &Path| check_model_path(p).map_err(|e| e.to_string());
    assert_eq!(check(&test_model_path()), Ok(()));
    let d = scratch("path-check");
    let e = check(&d).unwrap_err();
    assert!(
        e.contains("a directory with neither a .gguf file nor config.json"),
        "{e}"
    );
    write_tiny_hf(&d, 4);
    assert_eq!(check(&d), Ok(()));
    load_model(&d, &crate::progress::NoProgress).expect("the checked checkpoint loads");
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    let e = check(&d).unwrap_err();
    assert!(e.contains("tokenizer.json"), "{e}");
    std::fs::write(d.join("tokenizer.json"), "{}").unwrap();
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    let e = check(&d).unwrap_err();
    assert!(e.contains("no *.safetensors files"), "{e}");
    let text = d.join("notes.txt");
    std::fs::write(&text, "GGU").unwrap();
    let e = check(&text).unwrap_err();
    assert!(e.ends_with("not a GGUF file (bad magic)"), "{e}");
    // A directory holding one GGUF file is that file, checked the same way.
    let g = scratch("path-check-gguf");
    std::fs::write(g.join("m.gguf"), "not gguf").unwrap();
    let e = check(&g).unwrap_err();
    assert!(e.contains("m.gguf") && e.contains("bad magic"), "{e}");
    std::fs::write(g.join("m.gguf"), b"GGUF\x03\0\0\0").unwrap();
    assert_eq!(check(&g), Ok(()));
}
