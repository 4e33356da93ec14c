//! A spinning thread team for the many short parallel kernel calls of one forward pass.
//!
//! A decode step on the CPU makes ~150-200 parallel kernel calls (packed matmuls, attention,
//! SwiGLU), each tens of microseconds long. Through rayon's fork-join, the other workers fall
//! asleep in the gaps between calls (the small ops of the layer run on one thread) and every call
//! pays a futex wake-up, which in a VM is an inter-processor interrupt: ~10 % of a decode step's
//! samples were in `futex_wake` / `futex_wait` (`perf`, SmolLM2 F32 decode). The team is
//! llama.cpp's answer (its `ggml_threadpool`, whose threads poll for the next graph node instead
//! of sleeping): for the length of one forward pass ([`with_team`]) the other workers of the
//! current rayon pool each run a loop that spins on the team's job word, and [`par_for`] hands
//! a call's tasks to them through one atomic counter, with the calling thread taking tasks too.
//!
//! Outside [`with_team`] (or when a task itself calls a kernel), [`par_for`] is rayon's
//! `into_par_iter().for_each`, so the kernels work the same in any context. The results do not
//! depend on which thread runs a task: tasks write disjoint outputs, as with rayon.
//!
//! # Protocol
//! One `AtomicU64` job word holds `generation (32 bits) | tasks (16) | next task (16)`. The owner
//! publishes a job by storing the job's closure pointer, then the word with a new generation
//! and `next = 0` (release). A thread claims task `i` with a compare-and-swap of the word from
//! `next = i` to `i + 1` while `i < tasks`; a successful claim means the owner is still waiting
//! for this job's tasks (it waits until the `done` counter reaches `tasks`), so the closure is
//! alive. A task that panics still counts as done (a drop guard) and the owner re-raises the
//! panic after the job.
//!
//! # Several passes at once
//! Forward passes on other threads (tests, several engines) share the pool: a member job may
//! start late, or never before its pass ends (the owner then takes all tasks itself), and a
//! worker waiting in a rayon join may pick up another team's member job and spin for that pass.
//! That cannot deadlock because the tasks are leaf computations (they make no rayon calls, so a
//! thread holding a claimed task never waits), and an owner never becomes a member.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use rayon::prelude::*;

/// Most tasks of one team job (the 16-bit field of the job word); longer calls go to rayon.
const MAX_TASKS: usize = u16::MAX as usize;

/// Spins between two `yield_now` calls of an idle member.
const SPINS_PER_YIELD: u32 = 1 << 12;

type Task<'a> = &'a (dyn Fn(usize) + Sync);

/// One job: the task closure (a thin pointer to the fat `&dyn Fn` on the owner's stack).
struct Job<'a> {
    f: Task<'a>,
}

struct Team {
    word: AtomicU64,
    job: AtomicPtr<Job<'static>>,
    done: AtomicUsize,
    panicked: AtomicBool,
    stop: AtomicBool,
}

thread_local! {
    /// The team whose owner is this thread, while [`with_team`] runs and no job is in flight.
    static TEAM: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// Whether this thread is inside [`with_team`] (owns a team, possibly mid-job).
    static OWNER: Cell<bool> = const { Cell::new(false) };
}

fn unpack(w: u64) -> (u64, usize, usize) {
    (w >> 32, ((w >> 16) & 0xFFFF) as usize, (w & 0xFFFF) as usize)
}

impl Team {
    /// Claims and runs tasks of the current job until none is left; true if it ran any.
    fn work(&self) -> bool {
        let mut ran = false;
        loop {
            let w = self.word.load(Ordering::Acquire);
            let (_, tasks, next) = unpack(w);
            if next >= tasks {
                return ran;
            }
            if self.word.compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Relaxed).is_err() {
                continue;
            }
            // The claim succeeded while `next < tasks`: the owner waits for this task, so the
            // job it published for this generation is alive.
            let job = self.job.load(Ordering::Acquire);
            struct Done<'a>(&'a Team);
            impl Drop for Done<'_> {
                fn drop(&mut self) {
                    if std::thread::panicking() {
                        self.0.panicked.store(true, Ordering::Relaxed);
                    }
                    self.0.done.fetch_add(1, Ordering::Release);
                }
            }
            let _done = Done(self);
            // SAFETY: see above; `job` points to the owner's live `Job`.
            let f = unsafe { (*job).f };
            f(next);
            ran = true;
        }
    }

    /// A member's loop: spin for jobs until the owner stops the team. A thread that owns a team
    /// itself (it picked this job up while waiting in a rayon join of its own forward pass)
    /// does not join: its own pass must not stall behind another one's.
    fn member(&self) {
        if OWNER.with(Cell::get) {
            return;
        }
        let mut idle = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            if self.work() {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle.is_multiple_of(SPINS_PER_YIELD) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Runs `tasks` tasks of `f` on the team (the owner takes tasks too) and waits for them.
    fn run(&self, tasks: usize, f: Task<'_>) {
        let job = Job { f };
        self.done.store(0, Ordering::Relaxed);
        self.job.store((&job as *const Job<'_>).cast_mut().cast(), Ordering::Release);
        let (generation, _, _) = unpack(self.word.load(Ordering::Relaxed));
        self.word.store(((generation + 1) & 0xFFFF_FFFF) << 32 | (tasks as u64) << 16, Ordering::Release);
        // The job must outlive every claimed task, so a panic of one of this thread's tasks is
        // held until the others are done.
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.work()));
        while self.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        let theirs = self.panicked.swap(false, Ordering::Relaxed);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if theirs {
            panic!("a kernel task panicked on a team thread");
        }
    }
}

/// Runs `f` with a spinning team made of the other workers of the current rayon pool, for the
/// kernel calls ([`par_for`]) that `f` makes on this thread. Call it on a worker of the pool
/// (inside `install` or `scope`); with one thread, or nested, it just runs `f`.
pub fn with_team<R>(f: impl FnOnce() -> R) -> R {
    let helpers = rayon::current_num_threads().saturating_sub(1);
    if helpers == 0 || rayon::current_thread_index().is_none() || OWNER.with(Cell::get) {
        return f();
    }
    let team = Team {
        word: AtomicU64::new(0),
        job: AtomicPtr::new(std::ptr::null_mut()),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    };
    struct Owner<'a>(&'a Team);
    impl Drop for Owner<'_> {
        fn drop(&mut self) {
            TEAM.with(|t| t.set(std::ptr::null()));
            OWNER.with(|o| o.set(false));
            self.0.stop.store(true, Ordering::Release);
        }
    }
    rayon::in_place_scope(|s| {
        for _ in 0..helpers {
            s.spawn(|_| team.member());
        }
        let _owner = Owner(&team);
        OWNER.with(|o| o.set(true));
        TEAM.with(|t| t.set(&team));
        f()
    })
}

/// `f(i)` for `i in 0..tasks`, in parallel: on this thread's team inside [`with_team`], else on
/// the current rayon pool. Returns when all tasks are done.
pub fn par_for(tasks: usize, f: impl Fn(usize) + Sync) {
    if tasks <= 1 {
        (0..tasks).for_each(f);
        return;
    }
    let team = TEAM.with(Cell::get);
    if team.is_null() || tasks > MAX_TASKS {
        (0..tasks).into_par_iter().for_each(&f);
        return;
    }
    // While the job runs, a kernel called from one of its tasks on this thread goes to rayon.
    TEAM.with(|t| t.set(std::ptr::null()));
    struct Restore(*const Team);
    impl Drop for Restore {
        fn drop(&mut self) {
            TEAM.with(|t| t.set(self.0));
        }
    }
    let _restore = Restore(team);
    // SAFETY: `team` was set by `with_team` on this thread and lives until it returns, which
    // cannot happen while this call runs.
    unsafe { (*team).run(tasks, &f) };
}

/// `f(i, chunk_i)` for the chunks of `chunk` elements of `data` (the last one shorter), in
/// parallel as [`par_for`]: `par_chunks_mut(chunk).enumerate().for_each` on the team.
pub fn par_chunks_mut<T: Send>(data: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let chunk = chunk.max(1);
    let len = data.len();
    // The tasks touch disjoint chunks of a slice of `Send` elements.
    let p = crate::quant::SyncPtr(data.as_mut_ptr());
    par_for(len.div_ceil(chunk), |i| {
        let start = i * chunk;
        let n = chunk.min(len - start);
        // SAFETY: chunk i is `data[start .. start + n]`, disjoint from every other task's chunk,
        // and `data` is borrowed mutably for the whole call.
        let c = unsafe { std::slice::from_raw_parts_mut(p.get().add(start), n) };
        f(i, c);
    });
}

/// `len` default values (zeros), written in parallel chunks when `len` is large: the output
/// buffers of the calibration products (up to hundreds of MB) are zeroed by every thread at
/// once instead of by the calling thread while the others wait. Small buffers are a plain
/// `vec!` (a fresh `calloc` needs no writes at all).
pub fn zeroed<T: Copy + Default + Send>(len: usize) -> Vec<T> {
    const PARALLEL_FROM: usize = 1 << 20;
    const CHUNK: usize = 1 << 16;
    if len < PARALLEL_FROM {
        return vec![T::default(); len];
    }
    let mut v: Vec<T> = Vec::with_capacity(len);
    par_chunks_mut(&mut v.spare_capacity_mut()[..len], CHUNK, |_, chunk| {
        for x in chunk {
            x.write(T::default());
        }
    });
    // SAFETY: the `len` elements of the spare capacity were all written above (the chunks cover
    // them, each written by exactly one task).
    unsafe { v.set_len(len) };
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_is_all_default() {
        for len in [0usize, 5, (1 << 20) + 3] {
            let v: Vec<f32> = zeroed(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|x| x.to_bits() == 0));
        }
    }

    /// Every task runs exactly once, with and without a team, nested calls included.
    #[test]
    fn every_task_once() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("pool");
        pool.install(|| {
            with_team(|| {
                for tasks in [0usize, 1, 2, 7, 100, 1000] {
                    let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                    par_for(tasks, |i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                        // A nested call goes to rayon and completes too.
                        par_for(3, |_| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                    });
                    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 4), "{tasks} tasks");
                }
                let mut v = vec![0usize; 1001];
                par_chunks_mut(&mut v, 64, |i, c| c.iter_mut().enumerate().for_each(|(k, x)| *x = i * 64 + k));
                assert!(v.iter().enumerate().all(|(i, &x)| i == x));
                let sum = AtomicUsize::new(0);
                par_for(10, |i| {
                    sum.fetch_add(i, Ordering::Relaxed);
                });
                assert_eq!(sum.load(Ordering::Relaxed), 45);
            });
        });
    }

    /// A panicking task (on the owner or on a member) reaches the caller instead of hanging.
    #[test]
    fn a_panic_reaches_the_caller() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
        for bad in [0usize, 37, 49] {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.install(|| with_team(|| par_for(50, |i| assert!(i != bad, "task {bad}"))));
            }));
            assert!(r.is_err(), "task {bad}: the panic reached the caller");
        }
    }
}
