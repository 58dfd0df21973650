//! Tests of the GGUF reader over files built in memory, including corrupted ones.

use super::*;

/// Builds GGUF files in memory for tests.
#[derive(Clone, Default)]
pub(crate) struct GgufWriter {
    kv: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    /// Overrides the version written (3 by default).
    pub version: Option<u32>,
}

fn str_bytes(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(s.as_bytes());
    b
}

impl GgufWriter {
    pub(crate) fn raw_kv(&mut self, key: &str, ty: u32, payload: Vec<u8>) -> &mut Self {
        self.kv.push((key.to_string(), ty, payload));
        self
    }
    pub(crate) fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.raw_kv(key, 4, v.to_le_bytes().to_vec())
    }
    pub(crate) fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.raw_kv(key, 6, v.to_le_bytes().to_vec())
    }
    pub(crate) fn string(&mut self, key: &str, v: &str) -> &mut Self {
        self.raw_kv(key, 8, str_bytes(v))
    }
    pub(crate) fn bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.raw_kv(key, 7, vec![u8::from(v)])
    }
    pub(crate) fn str_array(&mut self, key: &str, v: &[&str]) -> &mut Self {
        let mut p = 8u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for s in v {
            p.extend_from_slice(&str_bytes(s));
        }
        self.raw_kv(key, 9, p)
    }
    pub(crate) fn i32_array(&mut self, key: &str, v: &[i32]) -> &mut Self {
        let mut p = 5u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            p.extend_from_slice(&x.to_le_bytes());
        }
        self.raw_kv(key, 9, p)
    }
    /// Adds a tensor; `ne` is in GGUF order (contiguous dimension first).
    pub(crate) fn tensor(
        &mut self,
        name: &str,
        ne: &[u64],
        ggml_type: u32,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors
            .push((name.to_string(), ne.to_vec(), ggml_type, data));
        self
    }
    pub(crate) fn build(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&self.version.unwrap_or(3).to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, ty, p) in &self.kv {
            b.extend_from_slice(&str_bytes(k));
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(p);
        }
        let mut offset = 0u64;
        for (name, ne, ty, data) in &self.tensors {
            b.extend_from_slice(&str_bytes(name));
            b.extend_from_slice(&(ne.len() as u32).to_le_bytes());
            for d in ne {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            offset += (data.len() as u64).next_multiple_of(32);
        }
        b.resize(b.len().next_multiple_of(32), 0);
        for (_, _, _, data) in &self.tensors {
            b.extend_from_slice(data);
            b.resize(b.len().next_multiple_of(32), 0);
        }
        b
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn small_file() -> Vec<u8> {
    let mut w = GgufWriter::default();
    w.string("general.architecture", "llama")
        .u32("llama.block_count", 2)
        .f32("llama.rope.freq_base", 10000.0)
        .bool("flag", true)
        .str_array("tokenizer.ggml.tokens", &["a", "b", "ab"])
        .i32_array("tokenizer.ggml.token_type", &[1, 1, 3])
        .tensor(
            "w",
            &[4, 2],
            0,
            f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
        )
        .tensor("q", &[32], 3, vec![0u8; 20])
        .tensor("h", &[3], 1, vec![0u8; 6]);
    w.build()
}

fn parse(b: &[u8]) -> Result<GgufHeader, GpuError> {
    parse_header(b, Path::new("test.gguf"))
}

fn err_of(b: &[u8]) -> String {
    match parse(b) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn parses_metadata_and_tensors() {
    let h = parse(&small_file()).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.get_str("general.architecture"), Some("llama"));
    assert_eq!(h.get_usize("llama.block_count"), Some(2));
    assert_eq!(h.get_f32("llama.rope.freq_base"), Some(10000.0));
    assert_eq!(h.get("flag").and_then(GgufValue::as_bool), Some(true));
    let toks = h.get_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(toks[2].as_str(), Some("ab"));
    assert_eq!(h.tensors.len(), 3);
    let w = &h.tensors[0];
    assert_eq!(w.shape, vec![2, 4], "shape is reversed to PyTorch order");
    assert_eq!(w.dtype, DType::F32);
    assert_eq!(w.offset % 32, 0);
    assert_eq!(h.tensors[1].dtype, DType::Q4_1);
    assert_eq!(h.tensors[1].n_bytes, 20);
}

#[test]
fn parses_k_quant_and_5_bit_tensors() {
    // (ggml type, bytes per 256 values): Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
    let types = [
        (6, 176),
        (7, 192),
        (10, 84),
        (11, 110),
        (12, 144),
        (13, 176),
        (14, 210),
    ];
    let mut w = GgufWriter::default();
    for (i, &(ty, bytes)) in types.iter().enumerate() {
        w.tensor(&format!("t{i}"), &[256, 2], ty, vec![0; 2 * bytes]);
    }
    let h = parse(&w.build()).unwrap();
    let want = DType::FIVE_BIT_AND_K;
    for ((t, &(_, bytes)), dtype) in h.tensors.iter().zip(&types).zip(want) {
        assert_eq!(
            (t.dtype, t.shape.clone(), t.n_bytes),
            (dtype, vec![2, 256], 2 * bytes)
        );
    }
}

#[test]
fn weights_view_the_tensor_bytes() {
    let dir = crate::scratch::ScratchDir::new("gguf");
    let p = dir.join("small.gguf");
    std::fs::write(&p, small_file()).unwrap();
    let (_, w) = GgufFile::open(&p).unwrap().into_weights().unwrap();
    let t = w.get("w").unwrap();
    assert_eq!(t.shape, vec![2, 4]);
    assert_eq!(t.to_f32_vec(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    assert!(w
        .get("missing")
        .unwrap_err()
        .to_string()
        .contains("missing"));
}

#[test]
fn rejects_bad_magic_and_version() {
    let mut b = small_file();
    b[0] = b'X';
    assert!(err_of(&b).contains("magic"));
    let mut w = GgufWriter {
        version: Some(4),
        ..GgufWriter::default()
    };
    assert!(err_of(&w.build()).contains("version"));
    w.version = Some(1);
    assert!(err_of(&w.build()).contains("version"));
}

#[test]
fn rejects_every_truncation() {
    let b = small_file();
    // The last tensor's data ends before the final padding; cut anywhere before that.
    let end = parse(&b)
        .unwrap()
        .tensors
        .iter()
        .map(|t| t.offset + t.n_bytes)
        .max()
        .unwrap();
    for len in 0..end {
        assert!(parse(&b[..len]).is_err(), "truncated at {len} parsed");
    }
}

#[test]
fn rejects_huge_counts() {
    let mut b = small_file();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(err_of(&b).contains("tensor count"));
    let mut b = small_file();
    b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(err_of(&b).contains("metadata count"));
    let mut b = small_file();
    b[8..16].copy_from_slice(&60_000u64.to_le_bytes());
    assert!(err_of(&b).contains("overrun"));
}

#[test]
fn rejects_huge_strings_and_arrays() {
    let mut w = GgufWriter::default();
    let mut p = (u64::MAX).to_le_bytes().to_vec();
    p.extend_from_slice(b"x");
    w.raw_kv("k", 8, p);
    assert!(err_of(&w.build()).contains("string length"));

    let mut w = GgufWriter::default();
    let mut p = 0u32.to_le_bytes().to_vec();
    p.extend_from_slice(&(1u64 << 23).to_le_bytes());
    w.raw_kv("arr", 9, p);
    assert!(err_of(&w.build()).contains("overruns"));

    let mut w = GgufWriter::default();
    let mut p = 0u32.to_le_bytes().to_vec();
    p.extend_from_slice(&(1u64 << 40).to_le_bytes());
    w.raw_kv("arr", 9, p);
    assert!(err_of(&w.build()).contains("exceeds"));
}

#[test]
fn rejects_deeply_nested_arrays() {
    let mut p = Vec::new();
    for _ in 0..10 {
        p.extend_from_slice(&9u32.to_le_bytes());
        p.extend_from_slice(&1u64.to_le_bytes());
    }
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes());
    let mut w = GgufWriter::default();
    w.raw_kv("nest", 9, p);
    assert!(err_of(&w.build()).contains("nested"));
}

#[test]
fn accepts_nested_arrays_within_depth() {
    let mut p = 9u32.to_le_bytes().to_vec(); // array of arrays
    p.extend_from_slice(&2u64.to_le_bytes());
    for v in [[1u8, 2], [3, 4]] {
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend_from_slice(&2u64.to_le_bytes());
        p.extend_from_slice(&v);
    }
    let mut w = GgufWriter::default();
    w.raw_kv("nest", 9, p);
    let h = parse(&w.build()).unwrap();
    let outer = h.get_array("nest").unwrap();
    assert_eq!(
        outer[1],
        GgufValue::Array(vec![GgufValue::U8(3), GgufValue::U8(4)])
    );
}

/// Regression: every array element becomes a `GgufValue` of 32 bytes, so a file of
/// `u8` arrays cost 32 times its size; the elements of all arrays together are bounded.
#[test]
fn caps_metadata_array_elements_across_the_file() {
    // small_file's arrays hold 3 + 3 elements.
    let b = small_file();
    assert!(parse_header_limited(&b, Path::new("t"), 6).is_ok());
    let e = parse_header_limited(&b, Path::new("t"), 5)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer.ggml.token_type") && e.contains("more than 5 elements"),
        "{e}"
    );
    // A nested array counts its own elements and theirs: 2 + 2 * 2.
    let mut p = 9u32.to_le_bytes().to_vec();
    p.extend_from_slice(&2u64.to_le_bytes());
    for v in [[1u8, 2], [3, 4]] {
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend_from_slice(&2u64.to_le_bytes());
        p.extend_from_slice(&v);
    }
    let mut w = GgufWriter::default();
    w.raw_kv("nest", 9, p);
    let b = w.build();
    assert!(parse_header_limited(&b, Path::new("t"), 6).is_ok());
    let e = parse_header_limited(&b, Path::new("t"), 5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("more than 5 elements"), "{e}");
}

#[test]
fn open_refuses_what_is_not_a_regular_file() {
    let (_dir, irregular) = crate::model::testing::irregular_paths("gguf");
    for p in irregular {
        let e = GgufFile::open(&p).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{}: {e}", p.display());
    }
}

#[test]
fn rejects_bad_tensor_infos() {
    let mut w = GgufWriter::default();
    w.tensor("big", &[u64::MAX / 2, 4], 0, vec![]);
    assert!(err_of(&w.build()).contains("big"));

    let mut w = GgufWriter::default();
    w.tensor("t5", &[1, 1, 1, 1, 1], 0, vec![0; 4]);
    assert!(err_of(&w.build()).contains("dimensions"));

    let mut w = GgufWriter::default();
    w.tensor("zero", &[0], 0, vec![]);
    assert!(err_of(&w.build()).contains("zero"));

    let mut w = GgufWriter::default();
    w.tensor("k8", &[256], 15, vec![0; 292]);
    let e = err_of(&w.build());
    assert!(
        e.contains("unsupported tensor type Q8_K") && e.contains("k8"),
        "{e}"
    );

    // K-quant rows hold whole 256-value blocks.
    let mut w = GgufWriter::default();
    w.tensor("k4", &[128], 12, vec![0; 72]);
    assert!(err_of(&w.build()).contains("k4"));

    let mut w = GgufWriter::default();
    w.tensor("odd", &[33], 8, vec![0; 68]);
    assert!(err_of(&w.build()).contains("odd"));

    // Data beyond the end of the file.
    let mut w = GgufWriter::default();
    w.tensor("short", &[64], 0, vec![0; 16]);
    assert!(err_of(&w.build()).contains("outside the file"));
}

#[test]
fn rejects_misaligned_and_out_of_range_offsets() {
    let b = small_file();
    let h = parse(&b).unwrap();
    // Find the offset field of tensor "q" (second tensor): it is the u64 just before the
    // third tensor's name; locate it by searching for its encoded value after the name.
    let name_pos = b
        .windows(9)
        .position(|w| w == b"\x01\0\0\0\0\0\0\0q")
        .unwrap();
    let off_pos = name_pos + 9 + 4 + 8 + 4;
    let rel = (h.tensors[1].offset - h.data_offset) as u64;
    assert_eq!(&b[off_pos..off_pos + 8], &rel.to_le_bytes());
    let mut bad = b.clone();
    bad[off_pos..off_pos + 8].copy_from_slice(&(rel + 1).to_le_bytes());
    assert!(err_of(&bad).contains("misaligned"));
    let mut bad = b.clone();
    bad[off_pos..off_pos + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    assert!(parse(&bad).is_err());
    let mut bad = b;
    bad[off_pos..off_pos + 8].copy_from_slice(&(1u64 << 20).to_le_bytes());
    assert!(err_of(&bad).contains("outside the file"));
}

#[test]
fn bad_alignment_is_rejected() {
    let mut w = GgufWriter::default();
    w.u32("general.alignment", 48);
    assert!(err_of(&w.build()).contains("alignment"));
}

/// Flips bytes all over a valid file: every result must be an `Ok` or an `Err`, never a panic.
#[test]
fn byte_mutations_never_panic() {
    crate::fuzz::byte_mutations(&small_file(), 20_000, 0x9e37_79b9_7f4a_7c15, None, |b| {
        let _ = parse(b);
    });
}
