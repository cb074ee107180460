//! QueryPrefetch and Release. Group 0 answers the longest cached prefix through the tier
//! stack (`Loading` while it promotes a continuation from below DRAM); groups > 0 answer
//! membership per position in DRAM (all-or-nothing with `wait_for_full_prefix`). Hits are
//! leased to the instance.
//!
//! Owns the query answer and its metrics. Must never: lease a block of another namespace,
//! mint a lease for a miss, or start promotion I/O itself (the tier stack does, once per query).

use std::sync::Arc;

use super::acked::{self, AckedSave};
use super::command::{QueryAnswer, QueryCommand};
use super::instance::Instance;
use super::Engine;
use crate::error::{echo, EngineError, EngineResult};
use crate::store::PrefixAnswer;

fn ready(num: u64, lease: [u8; pegaflow_api::LEASE_BYTES], hit_positions: Vec<u32>) -> QueryAnswer {
    QueryAnswer::Ready {
        num_hit_blocks: num,
        lease: Some(lease),
        hit_positions,
    }
}

impl Engine {
    /// QueryPrefetch (`req_id` checked by the decoder). Unknown instance →
    /// FAILED_PRECONDITION; empty hash list → a miss.
    pub async fn query(&self, req: QueryCommand) -> EngineResult<QueryAnswer> {
        let inst = self.instance(&req.instance_id)?;
        // Saves answered before their copy ended, taken before the barrier: every Save
        // answered before this query is in it, or has queued its seal (`acked`).
        let acked = self.acked.snapshot();
        // Every Save that answered before this query is sealed and indexed first.
        self.sealer.settle().await;
        if req.hashes.is_empty() {
            return Ok(QueryAnswer::miss());
        }
        if req.group_id == 0 {
            self.query_prefix(&inst, &req, acked).await
        } else {
            self.query_membership(&inst, &req, acked).await
        }
    }

    /// Waits for `save` (an acknowledged Save of `acked` holding a block the query misses)
    /// to end, then for the seals queued meanwhile; drops it from `acked`, so that each is
    /// waited for at most once. A wait past [`acked::ACKED_WAIT_LIMIT`] is logged and
    /// counted, and the query answers with what is indexed.
    async fn await_acked(&self, acked: &mut Vec<Arc<AckedSave>>, save: Arc<AckedSave>) {
        if !self.acked.wait_ended(&save).await {
            self.metrics.query_acked_wait_timeouts.inc();
            tracing::warn!(
                limit_s = acked::ACKED_WAIT_LIMIT.as_secs(),
                "a query waited for an answered Save's copy past the limit; it answers without its blocks"
            );
        }
        acked.retain(|s| !Arc::ptr_eq(s, &save));
        self.sealer.settle().await;
    }

    /// Group 0: the longest cached prefix, through the tier stack (which answers Loading
    /// while it promotes a continuation from below DRAM); the hits are leased.
    async fn query_prefix(
        &self,
        inst: &Instance,
        req: &QueryCommand,
        mut acked: Vec<Arc<AckedSave>>,
    ) -> EngineResult<QueryAnswer> {
        // Blocks below DRAM of another slot layout (another model sharing the namespace, a
        // record from an older deployment) are a miss for this instance.
        let expect = inst
            .state
            .lock()
            .topology
            .as_ref()
            .and_then(|t| t.block_shape(0));
        let hits = loop {
            let answer = self
                .store
                .query_prefix(&inst.namespace, &req.req_id, &req.hashes, expect.as_ref())
                .await;
            // The prefix stops at a block whose Save was answered before its copy ended:
            // wait for that Save's seal, then look again (`acked`).
            let pending = match &answer {
                PrefixAnswer::Ready(hits) => req
                    .hashes
                    .get(hits.len())
                    .and_then(|next| acked::pending_in(&acked, &inst.namespace, 0, next))
                    .cloned(),
                PrefixAnswer::Loading => None,
            };
            let Some(save) = pending else {
                break answer;
            };
            drop(answer);
            self.await_acked(&mut acked, save).await;
        };
        let hits = match hits {
            PrefixAnswer::Ready(hits) => hits,
            PrefixAnswer::Loading => {
                self.metrics
                    .query_answers
                    .with_label_values(&["loading"])
                    .inc();
                return Ok(QueryAnswer::Loading);
            }
        };
        self.metrics
            .query_answers
            .with_label_values(&["ready"])
            .inc();
        let n = hits.len() as u64;
        let total = req.hashes.len() as u64;
        self.metrics.cache_block_hits.inc_by(n);
        self.metrics.cache_block_misses.inc_by(total - n);
        let tiers = &self.metrics.cache_tier_block_requests;
        tiers
            .with_label_values(&[self.store.pool().metric_label()])
            .inc_by(n);
        tiers.with_label_values(&["miss"]).inc_by(total - n);
        if hits.is_empty() {
            return Ok(QueryAnswer::miss());
        }
        let lease = self.mint_live(inst, hits)?;
        self.metrics.leases_active.set(self.leases.len() as i64);
        Ok(ready(n, lease, vec![]))
    }

    /// Mints a lease over `hits` for `inst`, unless the instance began closing meanwhile (a
    /// prefix query awaits the tier stack, so a teardown can run between resolving the
    /// instance and minting): a lease minted after the teardown dropped the instance's leases
    /// would pin its blocks until the lease TTL. Teardown fences (`closing`) before it drops
    /// the leases, so either this check sees the fence or that drop sees the lease.
    fn mint_live(
        &self,
        inst: &Instance,
        hits: Vec<std::sync::Arc<crate::block::SealedBlock>>,
    ) -> EngineResult<[u8; pegaflow_api::LEASE_BYTES]> {
        let lease = self.leases.mint(&inst.id, hits, inst.world_size)?;
        if inst.state.lock().closing {
            let _ = self.leases.release(&lease);
            return Err(EngineError::precondition(format!(
                "instance {} is closing",
                echo(&inst.id)
            )));
        }
        Ok(lease)
    }

    /// Groups > 0: membership per position (all-or-nothing with `wait_for_full_prefix`), in
    /// DRAM; the hits are leased.
    async fn query_membership(
        &self,
        inst: &Instance,
        req: &QueryCommand,
        mut acked: Vec<Arc<AckedSave>>,
    ) -> EngineResult<QueryAnswer> {
        let ns: &str = &inst.namespace;
        // Membership (group > 0) needs the sealed topology to know the group.
        let topo = {
            let st = inst.state.lock();
            st.topology.clone().ok_or_else(|| {
                EngineError::invalid(format!(
                    "registration incomplete: {}/{} workers registered",
                    st.workers.len(),
                    inst.world_size
                ))
            })?
        };
        if req.group_id as usize >= topo.groups.len() {
            return Err(EngineError::invalid(format!(
                "unknown group id {} (instance {} has {} groups)",
                req.group_id,
                echo(&inst.id),
                topo.groups.len()
            )));
        }
        let mut hits = Vec::new();
        let mut positions = Vec::new();
        // One lock per index shard for the whole list; a miss whose Save was answered before
        // its copy ended waits for that Save's seal, and the list is looked up again.
        let found = loop {
            let found = self.store.get_touch_each(ns, req.group_id, &req.hashes);
            if acked.is_empty() {
                break found;
            }
            let pending = found
                .iter()
                .zip(req.hashes.iter())
                .filter(|(b, _)| b.is_none())
                .find_map(|(_, h)| acked::pending_in(&acked, ns, req.group_id, h))
                .cloned();
            let Some(save) = pending else {
                break found;
            };
            drop(found);
            self.await_acked(&mut acked, save).await;
        };
        for (i, b) in found.into_iter().enumerate() {
            if let Some(b) = b {
                hits.push(b);
                positions.push(i as u32);
            }
        }
        if hits.is_empty() || (req.wait_for_full_prefix && hits.len() != req.hashes.len()) {
            // All-or-nothing: a short answer is a miss without a lease.
            return Ok(QueryAnswer::miss());
        }
        let n = hits.len() as u64;
        let lease = self.mint_live(inst, hits)?;
        Ok(ready(n, lease, positions))
    }

    /// Release: drops a lease whatever its remaining shares.
    pub fn release(&self, lease: &[u8]) -> EngineResult<()> {
        let id = super::parse_lease(lease)?;
        self.leases.release(&id)?;
        self.metrics.leases_active.set(self.leases.len() as i64);
        Ok(())
    }
}
