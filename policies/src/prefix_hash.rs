//! Chained, keyed hashes that identify full KV blocks for automatic prefix caching.
//!
//! Follows vLLM's automatic prefix caching design (docs "Automatic Prefix Caching", V1
//! `kv_cache_utils.hash_block_tokens`): the hash of block *i* covers the hash of block
//! *i − 1*, the block's token ids and the extra keys that change the KV content (the LoRA
//! adapter) or that must isolate tenants (the cache salt). Equal hashes therefore mean equal
//! prefixes, so a block can be shared by every request whose prefix hashes to it.
//!
//! The hash is 128-bit SipHash-1-3 keyed with a per-process random key chosen by the caller
//! (`hash_key` of [`crate::Scheduler::new`]). vLLM's advisory GHSA-rm76-4mrf-v9r8 showed that
//! a predictable block hash lets a tenant forge collisions and read or poison another
//! tenant's cached KV; a secret key makes collisions unforgeable from outside, and 128 bits
//! make accidental ones negligible.

use siphasher::sip128::{Hasher128, SipHasher13};
use std::hash::Hasher;

use crate::types::TokenId;

/// Identity of a full block: keyed hash of (parent, tokens, adapter, salt).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrefixHash(pub u128);

/// The extra keys mixed into every block hash of one request.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct HashExtras {
    /// LoRA adapter id; a different adapter produces different KV.
    pub lora_adapter: Option<u32>,
    /// Tenant cache salt; 0 shares the cache with every tenant.
    pub cache_salt: u64,
}

/// Computes chained block hashes with a fixed key.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    /// First half of the SipHash key.
    k0: u64,
    /// Second half of the SipHash key.
    k1: u64,
}

impl BlockHasher {
    /// A hasher keyed with `key` (keep it secret and random per process).
    pub fn new(key: [u64; 2]) -> Self {
        Self {
            k0: key[0],
            k1: key[1],
        }
    }

    /// Hash of one full block given its parent's hash (`None` for the first block).
    pub fn hash_block(
        &self,
        parent: Option<PrefixHash>,
        tokens: &[TokenId],
        extras: HashExtras,
    ) -> PrefixHash {
        let mut h = SipHasher13::new_with_keys(self.k0, self.k1);
        match parent {
            Some(p) => {
                h.write_u8(1);
                h.write_u128(p.0);
            }
            None => h.write_u8(0),
        }
        h.write_u64(tokens.len() as u64);
        for &t in tokens {
            h.write_u32(t);
        }
        match extras.lora_adapter {
            Some(a) => {
                h.write_u8(1);
                h.write_u32(a);
            }
            None => h.write_u8(0),
        }
        h.write_u64(extras.cache_salt);
        PrefixHash(h.finish128().as_u128())
    }

    /// Extends `hashes` (the chain of `tokens`' leading full blocks) to cover `upto` blocks.
    ///
    /// Each block is hashed once; calling again with a larger `upto` only hashes the new
    /// blocks. `upto` is clamped to the number of full blocks in `tokens`.
    pub fn extend_chain(
        &self,
        hashes: &mut Vec<PrefixHash>,
        tokens: impl TokenSource,
        block_size: usize,
        upto: usize,
        extras: HashExtras,
    ) {
        if block_size == 0 {
            return;
        }
        let upto = upto.min(tokens.len() / block_size);
        let mut buf: Vec<TokenId> = Vec::new();
        while hashes.len() < upto {
            let i = hashes.len();
            let start = i * block_size;
            let block = tokens.range(start, start + block_size, &mut buf);
            let parent = hashes.last().copied();
            hashes.push(self.hash_block(parent, block, extras));
        }
    }
}

/// A token sequence that may be split in two parts (prompt, then generated output).
pub trait TokenSource {
    /// Total number of tokens.
    fn len(&self) -> usize;
    /// Whether there are no tokens.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Tokens `start..end` as one slice, copying into `buf` only when they straddle parts.
    fn range<'a>(&'a self, start: usize, end: usize, buf: &'a mut Vec<TokenId>) -> &'a [TokenId];
}

impl TokenSource for &[TokenId] {
    fn len(&self) -> usize {
        <[TokenId]>::len(self)
    }
    fn range<'a>(&'a self, start: usize, end: usize, _: &'a mut Vec<TokenId>) -> &'a [TokenId] {
        &self[start..end]
    }
}

/// Prompt followed by output tokens, without concatenating them.
#[derive(Copy, Clone, Debug)]
pub struct PromptAndOutput<'t> {
    /// Prompt tokens.
    pub prompt: &'t [TokenId],
    /// Generated tokens.
    pub output: &'t [TokenId],
}

impl PromptAndOutput<'_> {
    /// Token `i` (prompt first, then output); `i` must be below the total length.
    #[inline]
    pub fn get(&self, i: usize) -> TokenId {
        match self.prompt.get(i) {
            Some(&t) => t,
            None => self.output[i - self.prompt.len()],
        }
    }
}

impl TokenSource for PromptAndOutput<'_> {
    fn len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }
    fn range<'a>(&'a self, start: usize, end: usize, buf: &'a mut Vec<TokenId>) -> &'a [TokenId] {
        let p = self.prompt.len();
        if end <= p {
            &self.prompt[start..end]
        } else if start >= p {
            &self.output[start - p..end - p]
        } else {
            buf.clear();
            buf.extend_from_slice(&self.prompt[start..]);
            buf.extend_from_slice(&self.output[..end - p]);
            buf
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: [u64; 2] = [0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210];

    fn chain(tokens: &[TokenId], extras: HashExtras) -> Vec<PrefixHash> {
        let mut v = Vec::new();
        BlockHasher::new(KEY).extend_chain(&mut v, tokens, 4, usize::MAX, extras);
        v
    }

    #[test]
    fn chain_covers_only_full_blocks() {
        let toks: Vec<u32> = (0..11).collect();
        assert_eq!(chain(&toks, HashExtras::default()).len(), 2);
    }

    #[test]
    fn shared_prefix_gives_shared_hashes_until_divergence() {
        let a: Vec<u32> = vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        let mut b = a.clone();
        b[5] = 99; // second block differs
        let (ha, hb) = (
            chain(&a, HashExtras::default()),
            chain(&b, HashExtras::default()),
        );
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // The third block has equal tokens but a different parent, so it differs too.
        assert_ne!(ha[2], hb[2]);
    }

    #[test]
    fn block_hash_depends_on_parent_adapter_salt_and_key() {
        let h = BlockHasher::new(KEY);
        let t = [1, 2, 3, 4];
        let base = h.hash_block(None, &t, HashExtras::default());
        let with_parent = h.hash_block(Some(base), &t, HashExtras::default());
        let lora = HashExtras {
            lora_adapter: Some(0),
            cache_salt: 0,
        };
        let salted = HashExtras {
            lora_adapter: None,
            cache_salt: 7,
        };
        let others = [
            with_parent,
            h.hash_block(None, &t, lora),
            h.hash_block(None, &t, salted),
            BlockHasher::new([1, 2]).hash_block(None, &t, HashExtras::default()),
            h.hash_block(None, &[1, 2, 3, 5], HashExtras::default()),
        ];
        for o in others {
            assert_ne!(base, o);
        }
        assert_eq!(base, h.hash_block(None, &t, HashExtras::default()));
    }

    #[test]
    fn split_source_hashes_like_contiguous_tokens() {
        let all: Vec<u32> = (100..113).collect();
        let split = PromptAndOutput {
            prompt: &all[..6],
            output: &all[6..],
        };
        let mut v = Vec::new();
        BlockHasher::new(KEY).extend_chain(&mut v, split, 4, 1, HashExtras::default());
        assert_eq!(v.len(), 1);
        BlockHasher::new(KEY).extend_chain(&mut v, split, 4, 10, HashExtras::default());
        assert_eq!(v, chain(&all, HashExtras::default()));
    }

    #[test]
    fn chain_matches_hand_built_chain() {
        let h = BlockHasher::new(KEY);
        let toks: Vec<u32> = (0..8).collect();
        let b0 = h.hash_block(None, &toks[..4], HashExtras::default());
        let b1 = h.hash_block(Some(b0), &toks[4..], HashExtras::default());
        assert_eq!(chain(&toks, HashExtras::default()), vec![b0, b1]);
    }
}
