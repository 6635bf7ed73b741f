//! Buffer assignment for graph values, with the no-alias rule.
//!
//! Each value lives from the op that first writes it to the op that last reads it. Values whose
//! lifetimes do not overlap may share a buffer ("slot"). Lifetimes are closed intervals, so an
//! op's output is always live together with all of its inputs and can never share their slot:
//! a fused kernel never writes over an input it is still reading. [`Plan::check`] verifies this
//! independently of how the plan was made.

use crate::graph::{Graph, ValueId};

#[derive(Clone, Debug)]
pub struct Plan {
    /// Slot of each value.
    pub slot_of: Vec<usize>,
    /// Size of each slot in f32 elements for the batch size the plan was made for.
    pub slot_elems: Vec<usize>,
    pub max_tokens: usize,
    /// Rows of the values computed on the last token (`Rows::Last`): 1 for one sequence, the
    /// number of sequences for a batch of sequences (one last row each).
    pub max_last_rows: usize,
}

impl Plan {
    pub fn slot(&self, v: ValueId) -> usize {
        self.slot_of[v.0 as usize]
    }

    /// Total f32 elements over all slots.
    pub fn total_elems(&self) -> usize {
        self.slot_elems.iter().sum()
    }

    /// Verify the aliasing rule and that every slot is large enough for its values.
    pub fn check(&self, graph: &Graph) -> Result<(), String> {
        for (i, op) in graph.ops.iter().enumerate() {
            let w = op.writes();
            for r in op.reads() {
                if r != w && self.slot(r) == self.slot(w) {
                    return Err(format!(
                        "op {i} ({}) writes `{}` into the buffer of its input `{}`",
                        op.kind(),
                        graph.value(w).name,
                        graph.value(r).name
                    ));
                }
            }
        }
        // Two values may share a slot only if their lifetimes are disjoint.
        let life = lifetimes(graph);
        for a in 0..graph.values.len() {
            let need = graph.values[a].width * graph.values[a].rows_for(self.max_tokens, self.max_last_rows);
            if need > self.slot_elems[self.slot_of[a]] {
                return Err(format!("slot of `{}` is too small", graph.values[a].name));
            }
            for b in a + 1..graph.values.len() {
                if self.slot_of[a] == self.slot_of[b] && overlaps(life[a], life[b]) {
                    return Err(format!(
                        "`{}` and `{}` are live together but share a buffer",
                        graph.values[a].name, graph.values[b].name
                    ));
                }
            }
        }
        Ok(())
    }
}

type Interval = Option<(usize, usize)>;

fn overlaps(a: Interval, b: Interval) -> bool {
    match (a, b) {
        (Some((a0, a1)), Some((b0, b1))) => a0 <= b1 && b0 <= a1,
        _ => false,
    }
}

/// `[first write, last access]` per value (`None` for values no op touches). Traced values and
/// the logits live to the end, so they can be read back after a forward pass.
fn lifetimes(graph: &Graph) -> Vec<Interval> {
    let mut life: Vec<Interval> = vec![None; graph.values.len()];
    let end = graph.ops.len();
    for (i, op) in graph.ops.iter().enumerate() {
        for v in op.reads().into_iter().chain(std::iter::once(op.writes())) {
            let l = &mut life[v.0 as usize];
            *l = Some(match *l {
                None => (i, i),
                Some((s, _)) => (s, i),
            });
        }
    }
    for (v, info) in graph.values.iter().enumerate() {
        if info.traced || v == graph.logits.0 as usize {
            if let Some((s, _)) = life[v] {
                life[v] = Some((s, end));
            }
        }
    }
    life
}

/// Greedy interval allocation: values in order of first write take the smallest free slot that
/// fits (or grow the largest free one), and release it after their last access.
/// With `reuse == false` every value gets its own slot (used to test the planner itself).
pub fn plan(graph: &Graph, max_tokens: usize, reuse: bool) -> Plan {
    plan_rows(graph, max_tokens, 1, reuse)
}

/// [`plan`] for batches of up to `max_last_rows` sequences, whose `Rows::Last` values hold one
/// row per sequence.
pub fn plan_rows(graph: &Graph, max_tokens: usize, max_last_rows: usize, reuse: bool) -> Plan {
    let life = lifetimes(graph);
    let mut order: Vec<usize> = (0..graph.values.len()).filter(|&v| life[v].is_some()).collect();
    order.sort_by_key(|&v| life[v].unwrap().0);
    let mut slot_of = vec![usize::MAX; graph.values.len()];
    let mut slot_elems: Vec<usize> = Vec::new();
    // (slot, free-from op index): a slot is free for a value starting at op s if its last user ended before s.
    let mut busy_until: Vec<usize> = Vec::new();
    for v in order {
        let (start, end) = life[v].unwrap();
        let need = graph.values[v].width * graph.values[v].rows_for(max_tokens, max_last_rows);
        let free = (0..slot_elems.len()).filter(|&s| reuse && busy_until[s] < start);
        let best = free
            .clone()
            .filter(|&s| slot_elems[s] >= need)
            .min_by_key(|&s| slot_elems[s])
            .or_else(|| free.max_by_key(|&s| slot_elems[s]));
        let s = match best {
            Some(s) => s,
            None => {
                slot_elems.push(0);
                busy_until.push(0);
                slot_elems.len() - 1
            }
        };
        slot_elems[s] = slot_elems[s].max(need);
        busy_until[s] = end;
        slot_of[v] = s;
    }
    // Values no op touches get a slot of their own so every id maps somewhere valid.
    for (v, s) in slot_of.iter_mut().enumerate() {
        if *s == usize::MAX {
            slot_elems.push(graph.values[v].width * graph.values[v].rows_for(max_tokens, max_last_rows));
            *s = slot_elems.len() - 1;
        }
    }
    Plan { slot_of, slot_elems, max_tokens, max_last_rows }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{AttentionShape, GraphBuilder, NormSpec, Op, Rows, WeightId};
    use proptest::prelude::*;

    fn finish(g: GraphBuilder, logits: ValueId) -> Graph {
        let att = AttentionShape { n_heads: 1, n_kv_heads: 1, head_dim: 2, scale: 1.0 };
        g.finish(logits, 0, att)
    }

    /// A random chain of elementwise/linear ops where each op reads one or two earlier values.
    fn random_graph(choices: &[(u8, usize, usize)]) -> Graph {
        let mut g = GraphBuilder::new();
        let first = g.value("v0", 8, Rows::Tokens);
        g.push(Op::Embed { table: WeightId(0), out: first, scale: 1.0 });
        let mut vals = vec![first];
        for (i, &(kind, a, b)) in choices.iter().enumerate() {
            let a = vals[a % vals.len()];
            let b = vals[b % vals.len()];
            let out = g.value(format!("v{}", i + 1), 8, Rows::Tokens);
            g.push(match kind % 3 {
                0 => Op::Add { a, b, out },
                1 => Op::Linear { x: a, norm: None, w: WeightId(0), bias: None, residual: Some(b), out, out_col: 0 },
                _ => Op::RmsNorm { x: a, norm: NormSpec { weight: WeightId(0), eps: 1e-5 }, residual: None, out },
            });
            vals.push(out);
        }
        finish(g, *vals.last().unwrap())
    }

    proptest! {
        #[test]
        fn plans_never_alias_live_values(choices in prop::collection::vec((0u8..3, 0usize..100, 0usize..100), 1..60)) {
            let g = random_graph(&choices);
            let p = plan(&g, 4, true);
            prop_assert!(p.check(&g).is_ok(), "{:?}", p.check(&g));
        }
    }

    #[test]
    fn check_rejects_output_aliasing_input() {
        let g = random_graph(&[(0, 0, 0), (1, 1, 0)]);
        let mut p = plan(&g, 1, false);
        // Force op 2's output into the slot of its input.
        let (w, r) = (g.ops[2].writes(), g.ops[2].reads()[0]);
        p.slot_of[w.0 as usize] = p.slot(r);
        assert!(p.check(&g).unwrap_err().contains("writes"));
    }

    #[test]
    fn reuse_shrinks_memory() {
        let g = random_graph(&[(0, 0, 0), (2, 1, 1), (2, 2, 2), (2, 3, 3), (2, 4, 4), (2, 5, 5)]);
        let shared = plan(&g, 4, true);
        let separate = plan(&g, 4, false);
        assert!(shared.check(&g).is_ok() && separate.check(&g).is_ok());
        assert!(shared.total_elems() < separate.total_elems());
    }
}
