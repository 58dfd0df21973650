//! Byte-mutation testing of file parsers (model files and LoRA adapters are hostile input).

/// Calls `f` on `rounds` copies of `base`, each with 1 to 4 bytes replaced (by a random byte,
/// 0xff or 0) and one in eight also cut short, from a xorshift stream seeded with `seed`. With
/// `hot`, three changes in four fall in the first `hot` bytes (a file's header, where its
/// structure is).
pub(crate) fn byte_mutations(
    base: &[u8],
    rounds: usize,
    seed: u64,
    hot: Option<usize>,
    mut f: impl FnMut(&[u8]),
) {
    let mut state = seed;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..rounds {
        let mut b = base.to_vec();
        for _ in 0..(next() % 4 + 1) {
            let span = match hot {
                Some(h) if next() % 4 != 0 => h.min(b.len()),
                _ => b.len(),
            };
            let i = (next() as usize) % span;
            b[i] = match next() % 3 {
                0 => next() as u8,
                1 => 0xff,
                _ => 0,
            };
        }
        let cut = if next() % 8 == 0 {
            (next() as usize) % b.len()
        } else {
            b.len()
        };
        f(&b[..cut]);
    }
}
