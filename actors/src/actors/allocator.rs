//! The KV block allocator actor: owns the block pool and its prefix cache.
//!
//! Only the scheduler's commits change the pool (one round trip per step), so the scheduler
//! plans against an exact view of it ([`switchyard_policies::BlockLedger`]) and a commit
//! never fails; a failure means the two diverged, which is reported, not hidden.

use actix::{Actor, Context, Handler, Message};
use switchyard_policies::{BlockId, BlockPool, KvCommit};

use crate::metric_names as names;
use crate::EngineError;

/// One step's block changes; the reply holds the ids of the blocks it allocated, in order.
#[derive(Message)]
#[rtype(result = "Result<Vec<BlockId>, EngineError>")]
pub struct Commit(pub KvCommit);

/// Owns the [`BlockPool`].
pub struct KvAllocatorActor {
    pool: BlockPool,
}

impl KvAllocatorActor {
    /// Takes over a pool (detached from the scheduler before its first step).
    pub fn new(pool: BlockPool) -> Self {
        Self { pool }
    }
}

impl Actor for KvAllocatorActor {
    type Context = Context<Self>;
}

impl Handler<Commit> for KvAllocatorActor {
    type Result = Result<Vec<BlockId>, EngineError>;

    fn handle(&mut self, msg: Commit, _: &mut Context<Self>) -> Self::Result {
        let mut ids = Vec::with_capacity(msg.0.allocate);
        self.pool.commit(&msg.0, &mut ids)?;
        metrics::gauge!(names::KV_CACHE_CACHED_BLOCKS).set(self.pool.num_cached() as f64);
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policies::PrefixHash;

    #[actix::test]
    async fn commits_allocate_in_order_and_bad_commits_are_errors() {
        let addr = KvAllocatorActor::new(BlockPool::new(4, 16).unwrap()).start();
        let ids = addr
            .send(Commit(KvCommit {
                allocate: 3,
                ..KvCommit::default()
            }))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ids, vec![0, 1, 2]);
        let freed = addr
            .send(Commit(KvCommit {
                cache: vec![(0, PrefixHash(5))],
                free: vec![0, 1, 2],
                allocate: 2,
                ..KvCommit::default()
            }))
            .await
            .unwrap()
            .unwrap();
        // Uncached frees are reused first, most recent first; the cached block 0 survives.
        assert_eq!(freed, vec![2, 1]);
        let err = addr
            .send(Commit(KvCommit {
                free: vec![3],
                ..KvCommit::default()
            }))
            .await
            .unwrap();
        assert!(err.is_err(), "freeing an unreferenced block must fail");
    }

    /// A block one sequence gives up while another takes a reference in the same commit (a
    /// block loaded from the host tier and shared by a request admitted in the same plan,
    /// whose loader ended): the block keeps one reference and no allocation of that commit
    /// takes it. (The pool would also revive it were the free applied first: its pins come
    /// first anyway, see `BlockPool::commit`.)
    #[actix::test]
    async fn a_pin_and_a_free_of_one_block_in_one_commit_keep_it() {
        let addr = KvAllocatorActor::new(BlockPool::new(4, 16).unwrap()).start();
        let first = addr
            .send(Commit(KvCommit {
                allocate: 1,
                ..KvCommit::default()
            }))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first, vec![0]);
        let ids = addr
            .send(Commit(KvCommit {
                pin: vec![0],
                free: vec![0],
                allocate: 3,
                ..KvCommit::default()
            }))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ids, vec![1, 2, 3]);
        // Block 0 kept one reference: freeing it once works, twice does not.
        let free = |b| {
            addr.send(Commit(KvCommit {
                free: vec![b],
                ..KvCommit::default()
            }))
        };
        assert!(free(0).await.unwrap().is_ok());
        assert!(free(0).await.unwrap().is_err());
    }
}
