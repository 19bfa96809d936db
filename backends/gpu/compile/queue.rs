//! The compile pool's queue, without threads (so its order is testable):
//! tasks named by a key, run by priority, with tasks a launch is waiting
//! for moved ahead of everything else, and lanes that cap how many tasks of
//! one kind run at once (one hipRTC compile at a time, say).

use std::collections::{BTreeMap, HashMap};

/// A class of tasks and how many of them may run at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lane {
    pub name: &'static str,
    pub limit: usize,
}

/// Lower runs first.
pub type Priority = u32;

/// Position in the queue: urgent (bumped) tasks first, in the order they
/// were bumped; then by priority; then in the order they were queued.
type Order = (bool, u64, u64);

struct Queued<T> {
    order: Order,
    lane: Lane,
    task: T,
}

/// Keyed tasks waiting to run.
pub struct TaskQueue<T> {
    order: BTreeMap<Order, String>,
    tasks: HashMap<String, Queued<T>>,
    running: HashMap<&'static str, usize>,
    seq: u64,
}

impl<T> Default for TaskQueue<T> {
    fn default() -> Self {
        TaskQueue {
            order: BTreeMap::new(),
            tasks: HashMap::new(),
            running: HashMap::new(),
            seq: 0,
        }
    }
}

impl<T> TaskQueue<T> {
    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Queue `task` under `key`. A key already queued keeps its task (the
    /// same work) and takes the better of the two priorities; returns
    /// whether `task` was queued.
    pub fn push(&mut self, key: String, lane: Lane, priority: Priority, task: T) -> bool {
        if self.raise(&key, priority) {
            return false;
        }
        let order = (false, u64::from(priority), self.next_seq());
        self.order.insert(order, key.clone());
        self.tasks.insert(key, Queued { order, lane, task });
        true
    }

    /// Give a queued `key` `priority` if that is better than its own; false
    /// when it is not queued.
    pub fn raise(&mut self, key: &str, priority: Priority) -> bool {
        let Some(q) = self.tasks.get(key) else {
            return false;
        };
        let (urgent, old, seq) = q.order;
        if !urgent && u64::from(priority) < old {
            self.reorder(key, (false, u64::from(priority), seq));
        }
        true
    }

    /// Move `key` ahead of every task not bumped before it (a launch waits
    /// for it). False when it is not queued (running, done, or unknown).
    pub fn bump(&mut self, key: &str) -> bool {
        match self.tasks.get(key) {
            Some(q) if q.order.0 => true,
            Some(_) => {
                let order = (true, 0, self.next_seq());
                self.reorder(key, order);
                true
            }
            None => false,
        }
    }

    fn reorder(&mut self, key: &str, order: Order) {
        if let Some(q) = self.tasks.get_mut(key) {
            self.order.remove(&q.order);
            q.order = order;
            self.order.insert(order, key.to_string());
        }
    }

    /// The first task whose lane has room, marked running in its lane.
    pub fn pop(&mut self) -> Option<(String, Lane, T)> {
        let running = &self.running;
        let found = self
            .urgent_then_rest()
            .find(|(_, key)| {
                self.tasks
                    .get(*key)
                    .is_some_and(|q| running.get(q.lane.name).copied().unwrap_or(0) < q.lane.limit.max(1))
            })
            .map(|(order, key)| (order, key.clone()));
        let (order, key) = found?;
        self.order.remove(&order);
        let q = self.tasks.remove(&key)?;
        *self.running.entry(q.lane.name).or_insert(0) += 1;
        Some((key, q.lane, q.task))
    }

    /// Tasks in run order: bumped ones (flag `true`) before the others.
    fn urgent_then_rest(&self) -> impl Iterator<Item = (Order, &String)> {
        let urgent = self.order.range((true, 0, 0)..).map(|(o, k)| (*o, k));
        let rest = self.order.range(..(true, 0, 0)).map(|(o, k)| (*o, k));
        urgent.chain(rest)
    }

    /// A task of `lane` has finished.
    pub fn done(&mut self, lane: Lane) {
        if let Some(n) = self.running.get_mut(lane.name) {
            *n = n.saturating_sub(1);
        }
    }

    #[cfg(test)]
    pub fn contains(&self, key: &str) -> bool {
        self.tasks.contains_key(key)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMPILE: Lane = Lane {
        name: "compile",
        limit: 1,
    };
    const LOAD: Lane = Lane {
        name: "load",
        limit: usize::MAX,
    };

    fn keys<T>(q: &mut TaskQueue<T>) -> Vec<String> {
        let mut out = Vec::new();
        while let Some((k, lane, _)) = q.pop() {
            out.push(k);
            q.done(lane);
        }
        out
    }

    #[test]
    fn priority_then_queue_order() {
        let mut q = TaskQueue::default();
        assert!(q.push("c".into(), LOAD, 2, ()));
        assert!(q.push("a".into(), LOAD, 0, ()));
        assert!(q.push("b".into(), LOAD, 0, ()));
        assert!(q.push("d".into(), LOAD, 1, ()));
        assert_eq!(keys(&mut q), ["a", "b", "d", "c"]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_key_is_queued_once_and_keeps_the_better_priority() {
        let mut q = TaskQueue::default();
        assert!(q.push("x".into(), LOAD, 5, 1));
        assert!(q.push("y".into(), LOAD, 3, 2));
        assert!(!q.push("x".into(), LOAD, 1, 3), "a second push of a key is not queued");
        assert!(!q.push("y".into(), LOAD, 9, 4), "a worse priority does not demote");
        assert_eq!(q.len(), 2);
        let (k, _, t) = q.pop().unwrap();
        assert_eq!((k.as_str(), t), ("x", 1), "x took priority 1 and kept its first task");
    }

    #[test]
    fn bumped_tasks_run_first_in_bump_order() {
        let mut q = TaskQueue::default();
        for (i, k) in ["a", "b", "c", "d"].into_iter().enumerate() {
            q.push(k.into(), LOAD, i as u32, ());
        }
        assert!(q.bump("d"));
        assert!(q.bump("c"));
        assert!(q.bump("d"), "bumping twice keeps the first bump's place");
        assert!(!q.bump("zz"));
        // A later push of the best priority does not overtake bumped tasks,
        // nor earlier tasks of its priority.
        q.push("e".into(), LOAD, 0, ());
        assert_eq!(keys(&mut q), ["d", "c", "a", "e", "b"]);
    }

    #[test]
    fn lanes_cap_running_tasks() {
        let mut q = TaskQueue::default();
        q.push("c1".into(), COMPILE, 0, ());
        q.push("c2".into(), COMPILE, 0, ());
        q.push("l1".into(), LOAD, 9, ());
        let (k, lane, _) = q.pop().unwrap();
        assert_eq!(k, "c1");
        // c2 must wait for c1: the load runs meanwhile.
        assert_eq!(q.pop().map(|t| t.0).as_deref(), Some("l1"));
        assert!(q.pop().is_none(), "the compile lane is full");
        q.bump("c2");
        assert!(q.pop().is_none(), "a bump does not lift the lane's cap");
        q.done(lane);
        assert_eq!(q.pop().map(|t| t.0).as_deref(), Some("c2"));
        assert!(!q.contains("c2") && q.is_empty());
    }
}
