//! Reading the Redis directory's script answers, and the cover plan a query's answer gives.

use pegaflow_plugin::NodePrefix;
use redis::Value;

use crate::limits::MAX_PLAN_SEGMENTS;

pub(super) fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        _ => None,
    }
}

pub(super) fn as_text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// An insert script's answer.
pub(super) enum InsertScript {
    /// The session does not hold the node record.
    UnknownSession,
    /// The node would own more than its cap; nothing of the script's keys was kept.
    Full { owned: i64 },
    /// Applied: per key `b'1'` where the node became an owner, and the 1-based positions of
    /// the reclaimable keys.
    Done {
        marks: Vec<u8>,
        reclaimable: Vec<usize>,
    },
}

pub(super) fn parse_insert_answer(v: &Value) -> Option<InsertScript> {
    let Value::Array(items) = v else {
        return None;
    };
    match items.as_slice() {
        [Value::Int(-1), ..] => Some(InsertScript::UnknownSession),
        [Value::Int(-2), owned, ..] => Some(InsertScript::Full {
            owned: as_int(owned)?,
        }),
        [Value::Int(0), _added, marks, positions @ ..] => {
            let marks = match marks {
                Value::BulkString(b) => b.clone(),
                Value::SimpleString(s) => s.clone().into_bytes(),
                _ => return None,
            };
            let reclaimable = positions
                .iter()
                .map(|p| as_int(p).and_then(|p| usize::try_from(p).ok()))
                .collect::<Option<_>>()?;
            Some(InsertScript::Done { marks, reclaimable })
        }
        _ => None,
    }
}

/// Each live owner's address with its runs of positions: `(start, end)` or `(start, len)`.
pub(super) type OwnerRuns = Vec<(String, Vec<(u32, u32)>)>;

/// A query script's answer: the stop position and each owner's `(start, len)` runs.
pub(super) fn parse_query_answer(v: &Value) -> Option<(u32, OwnerRuns)> {
    let Value::Array(items) = v else {
        return None;
    };
    let (stop, rest) = items.split_first()?;
    let stop = u32::try_from(as_int(stop)?).ok()?;
    let mut owners = Vec::with_capacity(rest.len());
    for o in rest {
        let Value::Array(o) = o else {
            return None;
        };
        let (addr, nums) = o.split_first()?;
        let nums: Vec<u32> = nums
            .iter()
            .map(|n| as_int(n).and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<_>>()?;
        let pairs = nums.chunks_exact(2);
        if !pairs.remainder().is_empty() {
            return None;
        }
        let runs = pairs.map(|p| (p[0], p[1])).collect();
        owners.push((as_text(addr)?, runs));
    }
    Some((stop, owners))
}

/// The greedy cover plan of positions `0..stop`: from each position, the owner whose run
/// there reaches furthest (ties: the smallest address) takes the rest of its run; at most
/// [`MAX_PLAN_SEGMENTS`] segments. `owners` holds each live owner's runs as sorted, disjoint
/// `[start, end)` ranges.
pub(super) fn cover_plan(owners: &[(String, Vec<(u32, u32)>)], stop: u32) -> Vec<NodePrefix> {
    let mut plan = Vec::new();
    let mut p = 0u32;
    while p < stop {
        let mut best: Option<(&str, u32)> = None;
        for (addr, runs) in owners {
            let i = runs.partition_point(|&(s, _)| s <= p);
            let Some(&(_, end)) = i.checked_sub(1).and_then(|i| runs.get(i)) else {
                continue;
            };
            if end <= p {
                continue;
            }
            let len = end.min(stop) - p;
            let better = match best {
                None => true,
                Some((b, l)) => len > l || (len == l && addr.as_str() < b),
            };
            if better {
                best = Some((addr, len));
            }
        }
        let Some((addr, len)) = best else { break };
        plan.push(NodePrefix {
            node: addr.to_string(),
            prefix_len: len,
        });
        if plan.len() == MAX_PLAN_SEGMENTS {
            break;
        }
        p += len;
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owners(v: &[(&str, &[(u32, u32)])]) -> OwnerRuns {
        v.iter().map(|(a, r)| (a.to_string(), r.to_vec())).collect()
    }

    fn plan(v: &[(&str, u32)]) -> Vec<NodePrefix> {
        v.iter()
            .map(|(n, l)| NodePrefix {
                node: n.to_string(),
                prefix_len: *l,
            })
            .collect()
    }

    #[test]
    fn cover_plan_is_greedy_by_reach_then_address() {
        // The longest run from each position wins; the walk goes on where it ends.
        let o = owners(&[("a", &[(0, 5)]), ("b", &[(2, 9)])]);
        assert_eq!(cover_plan(&o, 10), plan(&[("a", 5), ("b", 4)]));
        // Alternating holders; a node may serve several segments.
        let o = owners(&[("a", &[(0, 3), (5, 8)]), ("b", &[(3, 5)])]);
        assert_eq!(cover_plan(&o, 8), plan(&[("a", 3), ("b", 2), ("a", 3)]));
        // Ties go to the smaller address, whatever the order the owners came in.
        let o = owners(&[("c", &[(0, 4)]), ("b", &[(0, 4)])]);
        assert_eq!(cover_plan(&o, 4), plan(&[("b", 4)]));
        // The plan ends at `stop` even where a run would go on.
        let o = owners(&[("a", &[(0, 9)])]);
        assert_eq!(cover_plan(&o, 4), plan(&[("a", 4)]));
        assert!(cover_plan(&o, 0).is_empty());
        assert!(cover_plan(&[], 3).is_empty());
    }
}
