//! A request's scheduling state inside the core, and the read-only view policies get of it.

use crate::prefix_hash::{HashExtras, PrefixHash, PromptAndOutput};
use crate::speculative::NgramIndex;
use crate::types::{
    BlockId, FinishReason, Request, RequestId, RequestState, SloTargets, Timestamp, TokenId,
    PENDING_TOKEN,
};

/// What a cached-prefix lookup found for a waiting sequence (see `prefix_lookup.rs`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PrefixLookup {
    /// Tokens of its longest cached prefix.
    pub(crate) tokens: u32,
    /// Whether the first block past that prefix is one a request ahead of it is to compute
    /// (see [`SeqView::shares_pending_prefix`]).
    pub(crate) pending_ahead: bool,
}

/// Everything the core tracks about one request.
///
/// `repr(C)` with the fields every step touches first, so that a step reads two cache lines
/// per sequence: this is what keeps a 256-sequence step within its time budget.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub(crate) struct Sequence {
    /// Current life-cycle state.
    pub(crate) state: RequestState,
    /// Times this request was preempted.
    pub(crate) num_preemptions: u32,
    /// Tokens whose KV is in `block_table`.
    pub(crate) num_computed: usize,
    /// Length of `block_table` already sent in a plan (blocks past it are new).
    pub(crate) blocks_sent: usize,
    /// Leading blocks of `block_table` that are registered in (or came from) the cache.
    pub(crate) num_cached_blocks: usize,
    /// Prompt length (copied out of `req` for locality).
    pub(crate) prompt_len: usize,
    /// KV blocks, one per `block_size` tokens; empty unless running. The first
    /// `released_blocks` entries are [`crate::block_ledger::RELEASED_BLOCK`]: blocks that
    /// left every sliding window were given back while the sequence runs.
    pub(crate) block_table: Vec<BlockId>,
    /// Request id (copied out of `req` for locality).
    pub(crate) id: RequestId,
    /// Generated tokens so far (kept across preemption).
    pub(crate) output: Vec<TokenId>,
    /// Highest `num_computed` ever reached (recompute is not charged twice to policies).
    pub(crate) max_computed: usize,
    /// `limits.max_tokens` (copied for locality).
    pub(crate) max_tokens: u32,
    /// The EOS token to stop at (None when absent or ignored).
    pub(crate) stop_eos: Option<TokenId>,
    /// Whether `limits.stop_token_ids` is non-empty.
    pub(crate) has_stop_ids: bool,
    /// Whether the request's tier is marked preemptible.
    pub(crate) preemptible: bool,
    /// Its tier's position among the configured tiers, for the KV quota counts
    /// (`tier_quota.rs`); [`crate::tier_quota::NO_TIER`] for a tier not configured.
    pub(crate) tier: u8,
    /// Trailing entries of `output` that are [`PENDING_TOKEN`]s (sampled on the device, not
    /// yet resolved): 0, or 1-2 while steps are in flight.
    pub(crate) pending: u8,
    /// Dense per-scheduler tenant number (interned label).
    pub(crate) tenant_id: u32,
    /// When the first output token was produced.
    pub(crate) first_token_at: Option<Timestamp>,
    /// When the latest output token was produced.
    pub(crate) last_token_at: Option<Timestamp>,
    /// When the request last entered the waiting queue.
    pub(crate) queued_at: Timestamp,
    /// Adapter requests ranked behind this one admitted while it waited for a LoRA adapter
    /// slot (bounded: see the planner's `admit_waiting`).
    pub(crate) lora_passes: u32,
    /// Chained hashes of the leading full blocks of prompt + output (computed once each).
    pub(crate) hashes: Vec<PrefixHash>,
    /// SLO targets after filling gaps from the tier.
    pub(crate) slo: SloTargets,
    /// The request as submitted (prompt shared through `Arc`).
    pub(crate) req: Request,
    /// Index of the sequence's n-grams for draft proposals (built on the first one).
    pub(crate) ngrams: Option<Box<NgramIndex>>,
    /// A launched step fed drafts, its outputs not resolved yet: how many tokens it yields
    /// is unknown, so nothing more is scheduled for the sequence until then.
    pub(crate) speculating: bool,
    /// Leading entries of `block_table` given back (sliding window); 0 without one. Read
    /// only by windowed schedulers, so out of the fields every step touches.
    pub(crate) released_blocks: usize,
    /// What the planner's lookup for this step's ranking found (only for a policy that asks,
    /// see [`crate::Policy::prefix_lookups`]); `None` when it was not looked up, and always
    /// once admitted.
    pub(crate) cached_prefix: Option<PrefixLookup>,
    /// The latest cached-prefix walk: the ledger's `cache_drops` then and the leading blocks
    /// it found cached (still cached while no registration has been dropped since).
    pub(crate) prefix_walk: (u64, u32),
    /// Prompt tokens whose KV came from the prefix cache at the first admission (vLLM's
    /// `num_cached_tokens`, set once: an admission after a preemption does not change it);
    /// `None` until first admitted.
    pub(crate) first_cached: Option<u32>,
    /// Host-tier blocks ([`crate::HostTier`]) to copy into `block_table[load_at..]` with the
    /// plan that admitted it (taken when its blocks get their ids); empty otherwise.
    pub(crate) host_loads: Vec<BlockId>,
    /// Table index of the first block `host_loads` fills.
    pub(crate) load_at: usize,
}

impl Sequence {
    pub(crate) fn new(
        req: Request,
        slo: SloTargets,
        tenant_id: u32,
        preemptible: bool,
        tier: u8,
    ) -> Self {
        let l = &req.limits;
        Self {
            state: RequestState::Waiting,
            num_preemptions: 0,
            lora_passes: 0,
            pending: 0,
            num_computed: 0,
            blocks_sent: 0,
            num_cached_blocks: 0,
            prompt_len: req.prompt.len(),
            block_table: Vec::new(),
            released_blocks: 0,
            host_loads: Vec::new(),
            load_at: 0,
            id: req.id,
            output: Vec::new(),
            max_computed: 0,
            max_tokens: l.max_tokens,
            stop_eos: l.eos_token_id.filter(|_| !l.ignore_eos),
            has_stop_ids: !l.stop_token_ids.is_empty(),
            preemptible,
            tier,
            tenant_id,
            first_token_at: None,
            last_token_at: None,
            queued_at: req.arrival,
            hashes: Vec::new(),
            slo,
            req,
            ngrams: None,
            speculating: false,
            cached_prefix: None,
            prefix_walk: (0, 0),
            first_cached: None,
        }
    }

    /// The blocks the sequence holds a reference to: its table less the released entries.
    pub(crate) fn held_blocks(&self) -> &[BlockId] {
        self.block_table
            .get(self.released_blocks..)
            .unwrap_or_default()
    }

    /// Empties the block table (the caller drops the references).
    pub(crate) fn clear_blocks(&mut self) {
        self.block_table.clear();
        self.released_blocks = 0;
        self.blocks_sent = 0;
        self.num_cached_blocks = 0;
        self.host_loads.clear();
    }

    /// Prompt plus output tokens.
    pub(crate) fn num_tokens(&self) -> usize {
        self.prompt_len + self.output.len()
    }

    pub(crate) fn tokens(&self) -> PromptAndOutput<'_> {
        PromptAndOutput {
            prompt: &self.req.prompt,
            output: &self.output,
        }
    }

    pub(crate) fn hash_extras(&self) -> HashExtras {
        HashExtras {
            lora_adapter: self.req.lora_adapter,
            cache_salt: self.req.cache_salt.unwrap_or(0),
        }
    }

    /// Tokens whose values are known: everything but the trailing pending ones.
    pub(crate) fn num_known_tokens(&self) -> usize {
        self.num_tokens() - self.pending as usize
    }

    /// Tokens the planner may schedule now: the uncomputed ones, except that a sequence
    /// bound to finish by length once its pending token resolves, with a pending token
    /// already being fed (two steps in flight), or with drafts in flight, waits for the
    /// outputs.
    pub(crate) fn schedulable_tokens(&self) -> usize {
        let pending = usize::from(self.pending);
        if self.speculating
            || pending >= 2
            || (pending > 0 && self.output.len() >= self.max_tokens as usize)
        {
            return 0;
        }
        self.num_tokens() - self.num_computed
    }

    /// Drops the pending tokens (a preemption: they will be sampled again after the
    /// recompute).
    pub(crate) fn drop_pending(&mut self) {
        let keep = self.output.len() - self.pending as usize;
        debug_assert!(self.output[keep..].iter().all(|&t| t == PENDING_TOKEN));
        self.output.truncate(keep);
        self.pending = 0;
        self.speculating = false;
    }

    /// Checks the stop conditions for `token`, the `n`-th output token (1-based; vLLM's
    /// order: EOS/stop ids, then the length limit).
    ///
    /// An EOS or stop id ends the sequence even before `min_tokens`: the sampler enforces
    /// `min_tokens` by masking those ids, so one is sampled that early only where a grammar
    /// (structured output) allows nothing else, i.e. the grammar has finished and wins. Taking
    /// it as text there would go on outside the grammar.
    #[inline]
    pub(crate) fn stop_reason_at(&self, token: TokenId, n: usize) -> Option<FinishReason> {
        if self.stop_eos == Some(token) {
            return Some(FinishReason::Eos);
        }
        if self.has_stop_ids && self.req.limits.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        if n >= self.max_tokens as usize {
            return Some(FinishReason::Length);
        }
        None
    }
}

/// Read-only view of a sequence handed to policies.
#[derive(Copy, Clone, Debug)]
pub struct SeqView<'a> {
    /// The viewed sequence.
    seq: &'a Sequence,
}

impl<'a> SeqView<'a> {
    pub(crate) fn new(seq: &'a Sequence) -> Self {
        Self { seq }
    }

    /// The request id.
    pub fn id(&self) -> RequestId {
        self.seq.id
    }
    /// The tenant label.
    pub fn tenant(&self) -> &'a str {
        &self.seq.req.tenant
    }
    /// A dense number for the tenant, stable for the scheduler's lifetime (index tables
    /// with it instead of hashing the label on the hot path).
    pub fn tenant_id(&self) -> u32 {
        self.seq.tenant_id
    }
    /// Whether the request's tier is marked preemptible in the scheduler's config.
    pub fn preemptible(&self) -> bool {
        self.seq.preemptible
    }
    /// The tier name.
    pub fn tier(&self) -> &'a str {
        &self.seq.req.tier
    }
    /// The request's priority (lower = more urgent).
    pub fn priority(&self) -> i32 {
        self.seq.req.priority
    }
    /// The LoRA adapter, if any.
    pub fn lora_adapter(&self) -> Option<u32> {
        self.seq.req.lora_adapter
    }
    /// Arrival time.
    pub fn arrival(&self) -> Timestamp {
        self.seq.req.arrival
    }
    /// When the request last entered the waiting queue (arrival or latest preemption).
    pub fn queued_at(&self) -> Timestamp {
        self.seq.queued_at
    }
    /// SLO targets, with gaps filled from the tier.
    pub fn slo(&self) -> &'a SloTargets {
        &self.seq.slo
    }
    /// The life-cycle state.
    pub fn state(&self) -> RequestState {
        self.seq.state
    }
    /// Whether the sequence holds KV blocks.
    pub fn is_running(&self) -> bool {
        self.seq.state == RequestState::Running
    }
    /// Prompt length in tokens.
    pub fn prompt_len(&self) -> usize {
        self.seq.prompt_len
    }
    /// Output tokens generated so far (sampled tokens still on the device not counted).
    pub fn num_output_tokens(&self) -> usize {
        self.seq.output.len() - self.seq.pending as usize
    }
    /// The `max_tokens` limit.
    pub fn max_tokens(&self) -> usize {
        self.seq.max_tokens as usize
    }
    /// Tokens whose KV is computed.
    pub fn num_computed_tokens(&self) -> usize {
        self.seq.num_computed
    }
    /// Tokens still to feed before the next token can be sampled (1 for a decode).
    pub fn num_uncomputed_tokens(&self) -> usize {
        self.seq.num_tokens() - self.seq.num_computed
    }
    /// Whether more than one token must be fed before the next sample (prefill or recompute).
    pub fn is_prefill(&self) -> bool {
        self.num_uncomputed_tokens() > 1
    }
    /// When the first output token was produced.
    pub fn first_token_at(&self) -> Option<Timestamp> {
        self.seq.first_token_at
    }
    /// When the latest output token was produced.
    pub fn last_token_at(&self) -> Option<Timestamp> {
        self.seq.last_token_at
    }
    /// Times this request was preempted.
    pub fn num_preemptions(&self) -> u32 {
        self.seq.num_preemptions
    }
    /// Tokens of a waiting sequence's longest prefix (prompt, then output after a
    /// preemption) held in the prefix cache: what its admission would reuse, a whole number
    /// of blocks, never its last token, as of the planner's latest lookup, which it makes
    /// right before it ranks the waiting queue. `None` unless that lookup covered the
    /// sequence: only for a policy whose [`crate::Policy::prefix_lookups`]
    /// asks for it, with prefix caching on, and for the earliest-arrived waiting sequences up
    /// to that many; never for a running one.
    pub fn cached_prefix_tokens(&self) -> Option<usize> {
        self.seq.cached_prefix.map(|l| l.tokens as usize)
    }
    /// Whether the first block of a waiting sequence that the prefix cache lacks (the first
    /// its admission would compute) is also a block that a request ahead of it is to compute:
    /// a running sequence that has not computed it yet (a prefill in chunks), or a waiting
    /// sequence of the same lookup that arrived earlier (of the looked-up sequences sharing
    /// that block, the earliest arrival, then the lowest id, is not flagged unless a running
    /// one computes it). Admitted now, it would compute that block, and every later one it
    /// shares, a second time, beside the other; admitted once the other has computed them,
    /// it finds them cached. Blocks are compared by their prefix-cache hashes, so requests
    /// that may not share cached blocks (another adapter, cache salt or tenant) never share
    /// one here either. As of the same lookup as [`SeqView::cached_prefix_tokens`], and
    /// false whenever that is `None`; never true for a sequence whose cached prefix covers
    /// every block before its last token.
    pub fn shares_pending_prefix(&self) -> bool {
        self.seq.cached_prefix.is_some_and(|l| l.pending_ahead)
    }
}

// The per-step fields must stay within the first two cache lines.
const _: () = assert!(std::mem::offset_of!(Sequence, tenant_id) + 4 <= 128);
