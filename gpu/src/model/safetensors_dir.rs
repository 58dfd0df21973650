//! Hugging Face checkpoint directories: `config.json` plus one or more `*.safetensors` shards
//! (listed by `model.safetensors.index.json`, or every `*.safetensors` file in the directory),
//! memory-mapped and parsed with the `safetensors` crate. Tensor names are mapped to the
//! canonical GGUF names the backends use (`model.layers.3.self_attn.q_proj.weight` →
//! `blk.3.attn_q.weight`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::Dtype as StDtype;
use safetensors::SafeTensors;

use super::tensor::{DType, ModelWeights};
use crate::error::GpuError;

/// Most shard files accepted in one checkpoint.
pub const MAX_SHARDS: usize = 1024;
/// Largest `model.safetensors.index.json` accepted, in bytes.
const MAX_INDEX_JSON: u64 = 64 << 20;

/// The canonical (GGUF) name of a Hugging Face Llama tensor, or `None` for tensors the
/// backends do not use (e.g. `rotary_emb.inv_freq`).
pub fn canonical_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = suffix.rsplit_once('.')?;
    let part = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        // Phi-3's fused projections, named as llama.cpp names them (the loader splits them).
        "self_attn.qkv_proj" => "attn_qkv",
        "mlp.gate_up_proj" => "ffn_up",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    // Biases keep their names: Qwen2's on Q, K and V are used, any other is refused by
    // `validate_weights` rather than dropped here.
    if !matches!(kind, "weight" | "bias") {
        return None;
    }
    Some(format!("blk.{layer}.{part}.{kind}"))
}

/// The shard files of the checkpoint in `dir`, sorted. Each is a regular file (links are
/// followed).
pub fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, GpuError> {
    let index = dir.join("model.safetensors.index.json");
    let mut files = BTreeSet::new();
    if index.is_file() {
        let text = super::read_bounded(&index, MAX_INDEX_JSON)?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| GpuError::invalid_file(&index, e.to_string()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| GpuError::invalid_file(&index, "no weight_map object"))?;
        for file in map.values() {
            let name = file.as_str().ok_or_else(|| {
                GpuError::invalid_file(&index, "a weight_map value is not a string")
            })?;
            // Shards must be plain file names inside the directory.
            if name.is_empty() || name.contains('/') || name.contains('\\') || name.starts_with('.')
            {
                return Err(GpuError::invalid_file(
                    &index,
                    format!("bad shard name '{name}'"),
                ));
            }
            let shard = dir.join(name);
            if !files.contains(&shard) {
                super::open_regular(&shard).map(drop)?;
                files.insert(shard);
            }
            if files.len() > MAX_SHARDS {
                return Err(GpuError::invalid_file(&index, "too many shards"));
            }
        }
    } else {
        for entry in std::fs::read_dir(dir).map_err(|e| GpuError::io(dir, e))? {
            let p = entry.map_err(|e| GpuError::io(dir, e))?.path();
            if p.extension().is_some_and(|e| e == "safetensors") && p.is_file() {
                files.insert(p);
                if files.len() > MAX_SHARDS {
                    return Err(GpuError::invalid_file(dir, "too many safetensors files"));
                }
            }
        }
    }
    if files.is_empty() {
        return Err(GpuError::invalid_file(dir, "no *.safetensors files"));
    }
    Ok(files.into_iter().collect())
}

fn dtype_of(d: StDtype, tensor: &str) -> Result<DType, GpuError> {
    match d {
        StDtype::F32 => Ok(DType::F32),
        StDtype::F16 => Ok(DType::F16),
        StDtype::BF16 => Ok(DType::BF16),
        other => Err(GpuError::UnsupportedTensorType {
            tensor: tensor.to_string(),
            type_name: format!("{other:?}"),
        }),
    }
}

/// Maps every shard of the checkpoint in `dir` and registers its tensors under canonical
/// names. With `tie_word_embeddings`, `lm_head.weight` is left out (the embedding is used).
/// A shard must be a regular file, checked by path before it is opened and again once open.
pub fn load_safetensors_dir(
    dir: &Path,
    tie_word_embeddings: bool,
) -> Result<ModelWeights, GpuError> {
    let mut weights = ModelWeights::new();
    for path in shard_files(dir)? {
        let file = super::open_regular(&path)?;
        // SAFETY: read-only private map of a model file treated as immutable while loaded.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| GpuError::io(&path, e))?;
        let (header_len, meta) = SafeTensors::read_metadata(&mmap)
            .map_err(|e| GpuError::invalid_file(&path, e.to_string()))?;
        let data_start = 8usize
            .checked_add(header_len)
            .ok_or_else(|| GpuError::invalid_file(&path, "header size overflows"))?;
        let mut entries = Vec::new();
        for (hf_name, info) in meta.tensors() {
            let Some(name) = canonical_name(&hf_name) else {
                tracing::debug!(tensor = %hf_name, "ignoring tensor not used by Llama models");
                continue;
            };
            if tie_word_embeddings && name == "output.weight" {
                continue;
            }
            let dtype = dtype_of(info.dtype, &hf_name)?;
            let offset = data_start.checked_add(info.data_offsets.0).ok_or_else(|| {
                GpuError::invalid_file(&path, format!("{hf_name}: offset overflows"))
            })?;
            if dtype.tensor_bytes(&info.shape)
                != info.data_offsets.1.checked_sub(info.data_offsets.0)
            {
                return Err(GpuError::invalid_file(
                    &path,
                    format!("{hf_name}: data size does not match shape {:?}", info.shape),
                ));
            }
            entries.push((name, offset, dtype, info.shape.clone()));
        }
        let idx = weights.add_mmap(mmap);
        for (name, offset, dtype, shape) in entries {
            weights.insert_tensor(name, idx, offset, dtype, shape)?;
        }
    }
    Ok(weights)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView as StView;

    #[test]
    fn hf_names_map_to_gguf_names() {
        let cases = [
            ("model.embed_tokens.weight", Some("token_embd.weight")),
            (
                "model.layers.12.self_attn.o_proj.weight",
                Some("blk.12.attn_output.weight"),
            ),
            (
                "model.layers.3.self_attn.k_proj.bias",
                Some("blk.3.attn_k.bias"),
            ),
            (
                "model.layers.3.self_attn.o_proj.bias",
                Some("blk.3.attn_output.bias"),
            ),
            ("model.layers.3.mlp.up_proj.bias", Some("blk.3.ffn_up.bias")),
            ("model.layers.3.self_attn.q_proj.scale", None),
            (
                "model.layers.0.post_attention_layernorm.weight",
                Some("blk.0.ffn_norm.weight"),
            ),
            (
                "model.layers.3.mlp.down_proj.weight",
                Some("blk.3.ffn_down.weight"),
            ),
            ("model.layers.x.mlp.down_proj.weight", None),
            ("model.layers.1.self_attn.rotary_emb.inv_freq", None),
            ("lm_head.weight", Some("output.weight")),
        ];
        for (hf, want) in cases {
            assert_eq!(canonical_name(hf).as_deref(), want, "{hf}");
        }
    }

    fn bytes_f32(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn scratch(tag: &str) -> crate::scratch::ScratchDir {
        crate::scratch::ScratchDir::new(&format!("st-{tag}"))
    }

    #[test]
    fn loads_sharded_checkpoint_with_index() {
        let d = scratch("index");
        let emb = bytes_f32(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let norm: Vec<u8> = [half::bf16::from_f32(0.5), half::bf16::from_f32(-1.0)]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let q: Vec<u8> = [1.0f32, 0.0, 0.0, 1.0]
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect();
        let shard1 = vec![
            (
                "model.embed_tokens.weight",
                StView::new(StDtype::F32, vec![3, 2], &emb).unwrap(),
            ),
            (
                "model.norm.weight",
                StView::new(StDtype::BF16, vec![2], &norm).unwrap(),
            ),
        ];
        let shard2 = vec![
            (
                "model.layers.0.self_attn.q_proj.weight",
                StView::new(StDtype::F16, vec![2, 2], &q).unwrap(),
            ),
            (
                "lm_head.weight",
                StView::new(StDtype::F32, vec![3, 2], &emb).unwrap(),
            ),
            (
                "model.layers.0.self_attn.rotary_emb.inv_freq",
                StView::new(StDtype::F32, vec![1], &emb[..4]).unwrap(),
            ),
        ];
        safetensors::serialize_to_file(shard1, None, &d.join("a.safetensors")).unwrap();
        safetensors::serialize_to_file(shard2, None, &d.join("b.safetensors")).unwrap();
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"weight_map": {"model.embed_tokens.weight": "a.safetensors",
                "model.norm.weight": "a.safetensors", "lm_head.weight": "b.safetensors",
                "model.layers.0.self_attn.q_proj.weight": "b.safetensors"}}"#,
        )
        .unwrap();
        let w = load_safetensors_dir(&d, false).unwrap();
        assert_eq!(
            w.names(),
            vec![
                "blk.0.attn_q.weight",
                "output.weight",
                "output_norm.weight",
                "token_embd.weight"
            ]
        );
        let e = w.get("token_embd.weight").unwrap();
        assert_eq!((e.dtype, e.shape.clone()), (DType::F32, vec![3, 2]));
        assert_eq!(e.to_f32_vec(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(
            w.get("output_norm.weight").unwrap().to_f32_vec(),
            vec![0.5, -1.0]
        );
        assert_eq!(
            w.get("blk.0.attn_q.weight").unwrap().to_f32_vec(),
            vec![1.0, 0.0, 0.0, 1.0]
        );
        let tied = load_safetensors_dir(&d, true).unwrap();
        assert!(!tied.contains("output.weight"));
    }

    #[test]
    fn rejects_bad_checkpoints() {
        let d = scratch("bad");
        assert!(load_safetensors_dir(&d, false)
            .unwrap_err()
            .to_string()
            .contains("no *.safetensors"));
        let ints = vec![0u8; 8];
        let t = vec![(
            "model.norm.weight",
            StView::new(StDtype::I32, vec![2], &ints).unwrap(),
        )];
        safetensors::serialize_to_file(t, None, &d.join("m.safetensors")).unwrap();
        let e = load_safetensors_dir(&d, false).unwrap_err().to_string();
        assert!(
            e.contains("model.norm.weight") && e.contains("unsupported"),
            "{e}"
        );
        std::fs::write(
            d.join("m.safetensors"),
            b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk",
        )
        .unwrap();
        assert!(load_safetensors_dir(&d, false).is_err());
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"weight_map": {"x": "../etc/passwd"}}"#,
        )
        .unwrap();
        assert!(load_safetensors_dir(&d, false)
            .unwrap_err()
            .to_string()
            .contains("bad shard name"));
    }

    /// Regression: the shards named by the index were opened and mapped whatever they were;
    /// a FIFO blocks the open, and a directory or device is no shard.
    #[test]
    fn index_shards_must_be_regular_files() {
        let d = scratch("irregular");
        std::fs::create_dir_all(d.join("dir.safetensors")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.join("zero.safetensors")).unwrap();
        let mut names = vec!["dir.safetensors", "zero.safetensors", "missing.safetensors"];
        // No libc in this crate: make the FIFO with mkfifo(1) where there is one.
        if std::process::Command::new("mkfifo")
            .arg(d.join("fifo.safetensors"))
            .status()
            .is_ok_and(|s| s.success())
        {
            names.push("fifo.safetensors");
        }
        for name in names {
            std::fs::write(
                d.join("model.safetensors.index.json"),
                format!(r#"{{"weight_map": {{"model.norm.weight": "{name}"}}}}"#),
            )
            .unwrap();
            let e = load_safetensors_dir(&d, false).unwrap_err().to_string();
            let want = if name.starts_with("missing") {
                "I/O error"
            } else {
                "not a regular file"
            };
            assert!(e.contains(want), "{name}: {e}");
        }
    }
}
