//! How the ranks of a tensor-parallel model (see [`crate::shard`]) work together: the
//! [`Collective`] their executors call at each all-reduce of the graph, an in-process one over
//! threads ([`local_group`]), and [`RankThreads`], an [`Executor`] that drives one executor per
//! rank, each on a thread of its own. A multi-GPU backend keeps `RankThreads` (one thread per GPU)
//! and all-reduces device buffers through NCCL where the CPU ranks use [`LocalRank`].

use crate::executor::{Executor, LayerTrace, PagedKvConfig, SeqChunk};
use anyhow::{anyhow, bail, ensure};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

/// A rank's end of a communicator.
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn n_ranks(&self) -> usize;
    /// Replace `buf` by its element-wise sum over all ranks. Every rank calls this with a buffer
    /// of the same length, in the same order (the graph's all-reduces).
    fn all_reduce_sum(&self, buf: &mut [f32]) -> anyhow::Result<()>;
    /// Leave the group after a failure mid-step, when the others may be waiting for this rank:
    /// their all-reduces fail instead, now and from then on (as after NCCL's `ncclCommAbort`).
    fn abort(&self);
}

/// `n_ranks` ranks of one process, to be used by one thread each.
pub fn local_group(n_ranks: usize) -> Vec<LocalRank> {
    let state = State { bufs: vec![Vec::new(); n_ranks], arrived: 0, generation: 0, aborted: None };
    let group = Arc::new(Group { n_ranks, state: Mutex::new(state), turn: Condvar::new() });
    (0..n_ranks).map(|rank| LocalRank { rank, group: Arc::clone(&group) }).collect()
}

/// A rank of [`local_group`]. Its all-reduce gathers the ranks' buffers in shared memory and
/// sums them in rank order, so every rank gets the same bits, run after run. A rank that is
/// dropped (its thread panicked) aborts.
pub struct LocalRank {
    rank: usize,
    group: Arc<Group>,
}

struct Group {
    n_ranks: usize,
    state: Mutex<State>,
    turn: Condvar,
}

struct State {
    /// Each rank's contribution to the all-reduce in progress.
    bufs: Vec<Vec<f32>>,
    /// Ranks waiting at the barrier, and how many times it has opened.
    arrived: usize,
    generation: u64,
    /// The first rank that aborted.
    aborted: Option<usize>,
}

impl Group {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wait until every rank has arrived, or fail if one has aborted.
    fn barrier<'a>(&'a self, mut st: MutexGuard<'a, State>) -> anyhow::Result<MutexGuard<'a, State>> {
        if let Some(rank) = st.aborted {
            bail!("rank {rank} has aborted (it failed, or its thread went away): the ranks cannot all-reduce any more");
        }
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == self.n_ranks {
            st.arrived = 0;
            st.generation += 1;
            self.turn.notify_all();
            return Ok(st);
        }
        while st.generation == generation {
            if let Some(rank) = st.aborted {
                bail!("rank {rank} aborted (it failed, or its thread went away) while the others waited in an all-reduce");
            }
            st = self.turn.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        Ok(st)
    }
}

impl Collective for LocalRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn n_ranks(&self) -> usize {
        self.group.n_ranks
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> anyhow::Result<()> {
        let g = &*self.group;
        let mut st = g.lock();
        st.bufs[self.rank].clear();
        st.bufs[self.rank].extend_from_slice(buf);
        let st = g.barrier(st)?;
        // Every rank sees the same lengths, so all of them agree on failing.
        let lens: Vec<usize> = st.bufs.iter().map(Vec::len).collect();
        let same = lens.iter().all(|&l| l == buf.len());
        if same {
            buf.copy_from_slice(&st.bufs[0]);
            for b in &st.bufs[1..] {
                buf.iter_mut().zip(b).for_each(|(o, v)| *o += v);
            }
        }
        // Nobody overwrites a buffer before every rank has summed them.
        drop(g.barrier(st)?);
        ensure!(same, "all-reduce of different lengths {lens:?} on the ranks: they do not run the same graph");
        Ok(())
    }

    fn abort(&self) {
        self.group.lock().aborted.get_or_insert(self.rank);
        self.group.turn.notify_all();
    }
}

impl Drop for LocalRank {
    fn drop(&mut self) {
        self.abort();
    }
}

type Job<E> = Box<dyn FnOnce(&mut E) + Send>;

struct RankThread<E> {
    jobs: Option<mpsc::Sender<Job<E>>>,
    thread: Option<JoinHandle<()>>,
}

/// The ranks of a tensor-parallel model as one [`Executor`]: one executor per rank, each on a
/// thread of its own that builds it (a GPU context stays with its thread), called in lockstep —
/// every call goes to all ranks at once, since their collectives meet inside it — and answering
/// with rank 0's result: after the last all-reduce the ranks hold the same hidden state, and
/// the replicated output head gives them the same logits.
pub struct RankThreads<E> {
    ranks: Vec<RankThread<E>>,
    describe: String,
    context_len: usize,
    kv_bytes_per_position: usize,
    recurrent: bool,
}

impl<E: Executor + 'static> RankThreads<E> {
    /// One thread per builder (rank `r` runs `builders[r]`), all building at once.
    pub fn spawn<B>(builders: Vec<B>) -> anyhow::Result<Self>
    where
        B: FnOnce() -> anyhow::Result<E> + Send + 'static,
    {
        ensure!(!builders.is_empty(), "no ranks to run");
        let n = builders.len();
        let (ready_tx, ready) = mpsc::channel();
        let mut ranks = Vec::with_capacity(n);
        for (rank, build) in builders.into_iter().enumerate() {
            let (jobs, queue) = mpsc::channel::<Job<E>>();
            let ready_tx = ready_tx.clone();
            let thread = std::thread::Builder::new().name(format!("rank-{rank}")).spawn(move || match build() {
                Ok(mut exec) => {
                    let _ = ready_tx.send((rank, Ok(())));
                    queue.into_iter().for_each(|job| job(&mut exec));
                }
                Err(e) => drop(ready_tx.send((rank, Err(e)))),
            })?;
            ranks.push(RankThread { jobs: Some(jobs), thread: Some(thread) });
        }
        drop(ready_tx);
        // From here on, returning early drops `me`, which closes the queues and joins the threads.
        let mut me = Self { ranks, describe: String::new(), context_len: 0, kv_bytes_per_position: 0, recurrent: false };
        for _ in 0..n {
            match ready.recv() {
                Ok((_, Ok(()))) => {}
                Ok((rank, Err(e))) => return Err(e.context(format!("building rank {rank}"))),
                Err(_) => bail!("a rank's thread panicked while building its executor"),
            }
        }
        let info = me.each(|e| (e.describe(), e.context_len(), e.kv_bytes_per_position(), e.has_recurrent_state()))?;
        // The ranks must refuse the same calls up front (an error mid-step aborts the group).
        let contexts: Vec<usize> = info.iter().map(|i| i.1).collect();
        ensure!(contexts.iter().all(|&c| c == contexts[0]), "the ranks were built with different context lengths {contexts:?}");
        me.describe = format!("{n} ranks, each {}", info[0].0);
        (me.context_len, me.recurrent) = (info[0].1, info[0].3);
        me.kv_bytes_per_position = info.iter().map(|i| i.2).sum();
        Ok(me)
    }

    /// Run `f` on every rank's executor at once; the results in rank order.
    pub fn each<R: Send + 'static>(&self, f: impl Fn(&mut E) -> R + Send + Sync + 'static) -> anyhow::Result<Vec<R>> {
        self.on(self.ranks.len(), f)
    }

    /// Run `f` on the first `n` ranks (only calls without collectives may leave ranks out).
    fn on<R: Send + 'static>(&self, n: usize, f: impl Fn(&mut E) -> R + Send + Sync + 'static) -> anyhow::Result<Vec<R>> {
        let f = Arc::new(f);
        let replies: Vec<mpsc::Receiver<R>> = self.ranks[..n]
            .iter()
            .map(|t| {
                let (reply, rx) = mpsc::channel();
                let f = Arc::clone(&f);
                // A rank whose thread has died drops the job, and with it `reply`: reported below.
                if let Some(jobs) = &t.jobs {
                    let _ = jobs.send(Box::new(move |e: &mut E| drop(reply.send(f(e)))));
                }
                rx
            })
            .collect();
        replies.into_iter().enumerate().map(|(rank, rx)| rx.recv().map_err(|_| anyhow!("rank {rank} has stopped: its thread panicked"))).collect()
    }

    /// Rank 0's answer to a call that every rank ran.
    fn rank0<T>(results: anyhow::Result<Vec<anyhow::Result<T>>>) -> anyhow::Result<T> {
        let mut answers = Vec::new();
        for (rank, r) in results?.into_iter().enumerate() {
            answers.push(r.map_err(|e| e.context(format!("rank {rank}")))?);
        }
        answers.into_iter().next().ok_or_else(|| anyhow!("no ranks"))
    }
}

impl<E: Executor + 'static> Executor for RankThreads<E> {
    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn forward(&mut self, tokens: &[u32], start_pos: usize) -> anyhow::Result<()> {
        let tokens = tokens.to_vec();
        Self::rank0(self.each(move |e| e.forward(&tokens, start_pos)))
    }

    fn has_recurrent_state(&self) -> bool {
        self.recurrent
    }

    fn logits(&mut self) -> anyhow::Result<Vec<f32>> {
        Self::rank0(self.on(1, |e| e.logits()))
    }

    fn traces(&mut self) -> anyhow::Result<Vec<LayerTrace>> {
        Self::rank0(self.on(1, |e| e.traces()))
    }

    fn context_len(&self) -> usize {
        self.context_len
    }

    /// All ranks together: each caches its own kv heads.
    fn kv_bytes_per_position(&self) -> usize {
        self.kv_bytes_per_position
    }

    fn memory_report(&self) -> String {
        match self.each(|e| e.memory_report()) {
            Ok(reports) => reports.iter().enumerate().map(|(rank, r)| format!("rank {rank}:\n{r}")).collect::<Vec<_>>().join("\n"),
            Err(e) => format!("{e:#}"),
        }
    }

    fn init_paged(&mut self, config: PagedKvConfig) -> anyhow::Result<()> {
        Self::rank0(self.each(move |e| e.init_paged(config)))
    }

    fn forward_paged(&mut self, batch: &[SeqChunk<'_>]) -> anyhow::Result<Vec<Vec<f32>>> {
        let owned: Vec<(Vec<u32>, usize, Vec<u32>, usize)> = batch.iter().map(|s| (s.tokens.to_vec(), s.start_pos, s.block_table.to_vec(), s.state_slot)).collect();
        Self::rank0(self.each(move |e| {
            let batch: Vec<SeqChunk> = owned.iter().map(|(t, p, b, slot)| SeqChunk { tokens: t, start_pos: *p, block_table: b, state_slot: *slot }).collect();
            e.forward_paged(&batch)
        }))
    }

    fn warm_up_paged(&mut self) -> anyhow::Result<()> {
        Self::rank0(self.each(|e| e.warm_up_paged()))
    }
}

impl<E> Drop for RankThreads<E> {
    fn drop(&mut self) {
        // Close every queue first, so that no thread waits for a job while another is joined.
        self.ranks.iter_mut().for_each(|t| drop(t.jobs.take()));
        for t in &mut self.ranks {
            if let Some(thread) = t.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank gets the sum in rank order, bit for bit the same; a group of one is the identity.
    #[test]
    fn local_all_reduce_sums_in_rank_order() {
        let n = 4;
        let out: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = local_group(n)
                .into_iter()
                .map(|comm| {
                    s.spawn(move || {
                        let mut acc = Vec::new();
                        for step in 0..3 {
                            let r = comm.rank() as f32;
                            let mut buf = vec![1e8 * (r - 1.5), 1.0 + r, step as f32 * r];
                            comm.all_reduce_sum(&mut buf).unwrap();
                            acc.extend(buf);
                        }
                        acc
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want: Vec<f32> = (0..3)
            .flat_map(|step| {
                let sum = |f: &dyn Fn(f32) -> f32| (1..n).fold(f(0.0), |a, r| a + f(r as f32));
                [sum(&|r| 1e8 * (r - 1.5)), sum(&|r| 1.0 + r), sum(&|r| step as f32 * r)]
            })
            .collect();
        assert!(out.iter().all(|o| o == &want), "{out:?}");
        let one = local_group(1).pop().unwrap();
        let mut buf = [1.5f32, -2.0];
        one.all_reduce_sum(&mut buf).unwrap();
        assert_eq!(buf, [1.5, -2.0]);
    }

    /// A rank that aborts, or goes away, fails the others' all-reduces instead of hanging them,
    /// then and later; different lengths fail on every rank.
    #[test]
    fn local_all_reduce_fails_instead_of_hanging() {
        for drop_it in [false, true] {
            let mut group = local_group(3);
            let failing = group.pop().unwrap();
            let e = std::thread::scope(|s| {
                let waiting: Vec<_> = group.iter().map(|comm| s.spawn(move || comm.all_reduce_sum(&mut [1.0]))).collect();
                std::thread::sleep(std::time::Duration::from_millis(20));
                if drop_it {
                    drop(failing);
                } else {
                    failing.abort();
                }
                waiting.into_iter().map(|h| h.join().unwrap().unwrap_err().to_string()).collect::<Vec<_>>()
            });
            // A rank that was already waiting hears "aborted while the others waited", one that
            // arrives after the abort (a slow thread start) "has aborted": either is right.
            assert!(e.iter().all(|e| e.contains("rank 2 aborted") || e.contains("rank 2 has aborted")), "{e:?}");
            let later = group[0].all_reduce_sum(&mut [1.0]).unwrap_err().to_string();
            assert!(later.contains("rank 2 has aborted"), "{later}");
        }
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = local_group(2)
                .into_iter()
                .map(|comm| s.spawn(move || comm.all_reduce_sum(&mut vec![0.0; 1 + comm.rank()]).unwrap_err().to_string()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(errors.iter().all(|e| e.contains("different lengths [1, 2]")), "{errors:?}");
    }
}
