//! Warm pools of restored guests, as a pure state machine.
//!
//! A pool never runs anything itself: every operation returns the
//! [`Action`]s the executor must carry out, and the executor reports back
//! with [`Input`]s. The per-slot transition function [`step`] is total over
//! every (state, input) pair and is tested exhaustively.
//!
//! Pool kinds:
//! - **prewarm**: guests restored and stopped with SIGSTOP; checkout is a
//!   SIGCONT. Nothing survives a host reboot.
//! - **durable**: slots prepared on disk (own disk clone, NIC, the shared
//!   checkpoint); checkout restores on demand with vnode restore. Prepared
//!   slots survive a host reboot.
//! - **durable+prewarm**: durable slots that are also kept restored and
//!   stopped; after a reboot they are prepared again and re-warmed.

use std::collections::BTreeMap;

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PoolKind {
    Prewarm,
    Durable,
    DurablePrewarm,
}

impl PoolKind {
    fn keeps_restored(self) -> bool {
        matches!(self, Self::Prewarm | Self::DurablePrewarm)
    }
    fn durable(self) -> bool {
        matches!(self, Self::Durable | Self::DurablePrewarm)
    }
}

pub type SlotId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SlotState {
    /// Disk clone and NIC being created.
    Preparing,
    /// Everything on disk; no bhyve process.
    Prepared,
    /// bhyve restoring; the guest will be stopped when its agent is ready.
    RestoringToStop,
    /// bhyve restoring for a caller that is waiting for it.
    RestoringToHandOut,
    /// Restored, agent ready, process stopped (SIGSTOP).
    Warm,
    /// Handed out; belongs to a sandbox now.
    CheckedOut,
    /// Process, vmm instance, NIC and disk clone being removed.
    Destroying,
}

pub const ALL_STATES: [SlotState; 7] = [
    SlotState::Preparing,
    SlotState::Prepared,
    SlotState::RestoringToStop,
    SlotState::RestoringToHandOut,
    SlotState::Warm,
    SlotState::CheckedOut,
    SlotState::Destroying,
];

/// What happens to one slot: decisions of the pool and reports of the
/// executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// Pool: restore this prepared slot and stop it (prewarm).
    Warm,
    /// Pool: a caller takes this slot.
    Checkout,
    /// Pool: the caller is done with it.
    Return,
    /// Pool: empty the pool (checked-out guests are left alone).
    Drain,
    /// Executor: disk and NIC exist.
    PrepareDone,
    /// Executor: the guest's agent answered after restore.
    RestoreDone,
    /// Executor: a step failed or the process died.
    Failed,
    /// Executor: everything of the slot is gone.
    Destroyed,
    /// Executor: found after a host reboot (no process survived).
    HostRebooted,
}

pub const ALL_INPUTS: [Input; 9] = [
    Input::Warm,
    Input::Checkout,
    Input::Return,
    Input::Drain,
    Input::PrepareDone,
    Input::RestoreDone,
    Input::Failed,
    Input::Destroyed,
    Input::HostRebooted,
];

/// Work for the executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Create the slot's disk clone and NIC.
    Prepare(SlotId),
    /// Start bhyve from the checkpoint; stop the process (SIGSTOP) once the
    /// agent is ready if `stop`, and reset the guest's identity either way.
    Restore { slot: SlotId, stop: bool },
    /// SIGCONT a warm guest (its identity was reset before it was stopped).
    Continue(SlotId),
    /// Kill bhyve if running, destroy the vmm instance, NIC and disk clone.
    Destroy(SlotId),
}

/// Where a slot goes; `None` means the slot is forgotten.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub next: Option<SlotState>,
    pub action: Option<Action>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("slot {slot} cannot take {input:?} while {state:?}")]
    Invalid { slot: SlotId, state: SlotState, input: Input },
    #[error("no slot {0} in this pool")]
    Unknown(SlotId),
    #[error("the pool has no prepared or warm guest")]
    Empty,
}

/// The transition function of one slot in a pool of `kind`.
pub fn step(kind: PoolKind, slot: SlotId, state: SlotState, input: Input) -> Result<Step, PoolError> {
    use Input as I;
    use SlotState as S;
    let go = |next, action| Ok(Step { next: Some(next), action });
    let destroy = || go(S::Destroying, Some(Action::Destroy(slot)));
    match (state, input) {
        (S::Preparing, I::PrepareDone) => go(S::Prepared, None),
        (S::Preparing | S::Prepared | S::RestoringToStop | S::Warm, I::Drain) => destroy(),
        (S::Preparing | S::RestoringToStop | S::RestoringToHandOut, I::Failed) => destroy(),

        (S::Prepared, I::Warm) => go(S::RestoringToStop, Some(Action::Restore { slot, stop: true })),
        (S::Prepared, I::Checkout) => go(S::RestoringToHandOut, Some(Action::Restore { slot, stop: false })),
        // Durable slots live on disk; anything else a reboot left is junk.
        (S::Prepared, I::HostRebooted) if kind.durable() => go(S::Prepared, None),

        (S::RestoringToStop, I::RestoreDone) => go(S::Warm, None),
        (S::RestoringToHandOut, I::RestoreDone) => go(S::CheckedOut, None),
        // A caller is waiting on this restore; it finishes and is returned.
        (S::RestoringToHandOut, I::Drain) => go(S::RestoringToHandOut, None),

        (S::Warm, I::Checkout) => go(S::CheckedOut, Some(Action::Continue(slot))),
        (S::Warm, I::Failed) => destroy(),

        (S::CheckedOut, I::Return | I::Failed) => destroy(),
        (S::CheckedOut, I::Drain) => go(S::CheckedOut, None),

        (S::Destroying, I::Destroyed) => Ok(Step { next: None, action: None }),
        (S::Destroying, I::Drain) => go(S::Destroying, None),
        // Destroy is idempotent; a reboot mid-destroy just repeats it.
        (S::Destroying, I::HostRebooted | I::Failed) => destroy(),

        (_, I::HostRebooted) => destroy(),
        (state, input) => Err(PoolError::Invalid { slot, state, input }),
    }
}

/// One template's pool.
#[derive(Debug, Clone, Serialize)]
pub struct Pool {
    pub template: String,
    pub kind: PoolKind,
    /// Slots kept in stock (not checked out, not being destroyed).
    pub target: usize,
    slots: BTreeMap<SlotId, SlotState>,
    #[serde(skip)]
    next_id: SlotId,
}

impl Pool {
    pub fn new(template: impl Into<String>, kind: PoolKind) -> Self {
        Self { template: template.into(), kind, target: 0, slots: BTreeMap::new(), next_id: 1 }
    }

    /// Rebuild a pool from the slots found on disk after a restart, e.g. by
    /// the executor's scan of its state directory.
    pub fn adopt(
        template: impl Into<String>,
        kind: PoolKind,
        found: impl IntoIterator<Item = (SlotId, SlotState)>,
    ) -> Self {
        let mut pool = Self::new(template, kind);
        pool.slots.extend(found);
        pool.next_id = pool.slots.keys().max().map_or(1, |m| m + 1);
        pool
    }

    pub fn slot_states(&self) -> impl Iterator<Item = (SlotId, SlotState)> + '_ {
        self.slots.iter().map(|(id, s)| (*id, *s))
    }

    pub fn state(&self, slot: SlotId) -> Option<SlotState> {
        self.slots.get(&slot).copied()
    }

    /// Apply one input to one slot.
    pub fn apply(&mut self, slot: SlotId, input: Input) -> Result<Option<Action>, PoolError> {
        let state = self.state(slot).ok_or(PoolError::Unknown(slot))?;
        let step = step(self.kind, slot, state, input)?;
        match step.next {
            Some(next) => self.slots.insert(slot, next),
            None => self.slots.remove(&slot),
        };
        Ok(step.action)
    }

    fn in_stock(&self, state: SlotState) -> bool {
        use SlotState as S;
        matches!(state, S::Preparing | S::Prepared | S::RestoringToStop | S::Warm)
    }

    /// Keep `n` slots in stock from now on; returns the work to get there.
    pub fn warm(&mut self, n: usize) -> Vec<Action> {
        self.target = n;
        self.refill()
    }

    /// Work that brings the stock back to the target: new slots to prepare
    /// and, in pools that keep guests restored, prepared slots to restore.
    pub fn refill(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        let stock = self.slots.values().filter(|s| self.in_stock(**s)).count();
        for _ in stock..self.target {
            let id = self.next_id;
            self.next_id += 1;
            self.slots.insert(id, SlotState::Preparing);
            actions.push(Action::Prepare(id));
        }
        if self.kind.keeps_restored() {
            let prepared: Vec<SlotId> =
                self.slots.iter().filter(|(_, s)| **s == SlotState::Prepared).map(|(id, _)| *id).collect();
            for id in prepared {
                actions.extend(self.apply(id, Input::Warm).expect("prepared slots can be warmed"));
            }
        }
        actions
    }

    /// Take the fastest guest there is: a warm one, else a prepared one
    /// restored now. The caller is handed the slot once it is
    /// [`SlotState::CheckedOut`]; replacement work comes with it.
    pub fn checkout(&mut self) -> Result<(SlotId, Vec<Action>), PoolError> {
        let pick = |want: SlotState| self.slots.iter().find(|(_, s)| **s == want).map(|(id, _)| *id);
        let slot = pick(SlotState::Warm).or_else(|| pick(SlotState::Prepared)).ok_or(PoolError::Empty)?;
        let mut actions: Vec<Action> = self.apply(slot, Input::Checkout)?.into_iter().collect();
        actions.extend(self.refill());
        Ok((slot, actions))
    }

    /// The caller is done: destroy the guest and top the stock up.
    pub fn give_back(&mut self, slot: SlotId) -> Result<Vec<Action>, PoolError> {
        let mut actions: Vec<Action> = self.apply(slot, Input::Return)?.into_iter().collect();
        actions.extend(self.refill());
        Ok(actions)
    }

    /// Stop keeping stock and destroy every guest nobody holds.
    pub fn drain(&mut self) -> Vec<Action> {
        self.target = 0;
        let ids: Vec<SlotId> = self.slots.keys().copied().collect();
        ids.into_iter()
            .filter_map(|id| self.apply(id, Input::Drain).expect("drain is accepted in every state"))
            .collect()
    }

    /// After a host reboot: keep durable prepared slots, clean up the rest,
    /// then refill.
    pub fn after_reboot(&mut self) -> Vec<Action> {
        let ids: Vec<SlotId> = self.slots.keys().copied().collect();
        let mut actions: Vec<Action> = ids
            .into_iter()
            .filter_map(|id| self.apply(id, Input::HostRebooted).expect("every state accepts a reboot"))
            .collect();
        actions.extend(self.refill());
        actions
    }

    /// `list` output: the pool, its slots and counts per state.
    pub fn to_json(&self) -> serde_json::Value {
        let mut counts = BTreeMap::new();
        for state in self.slots.values() {
            *counts.entry(*state).or_insert(0usize) += 1;
        }
        serde_json::json!({
            "template": self.template,
            "kind": self.kind,
            "target": self.target,
            "slots": self.slots.iter().map(|(id, s)| serde_json::json!({"id": id, "state": s})).collect::<Vec<_>>(),
            "counts": counts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action as A;
    use Input as I;
    use SlotState as S;

    /// The whole transition table, written out. Rows not listed are
    /// invalid. `kind` only matters for reboots of prepared slots.
    fn expected(kind: PoolKind, state: SlotState, input: Input) -> Option<(Option<SlotState>, Option<Action>)> {
        let id = 7;
        let destroy = Some((Some(S::Destroying), Some(A::Destroy(id))));
        Some(match (state, input) {
            (S::Preparing, I::PrepareDone) => (Some(S::Prepared), None),
            (S::Preparing, I::Drain | I::Failed | I::HostRebooted) => return destroy,
            (S::Prepared, I::Warm) => (Some(S::RestoringToStop), Some(A::Restore { slot: id, stop: true })),
            (S::Prepared, I::Checkout) => (Some(S::RestoringToHandOut), Some(A::Restore { slot: id, stop: false })),
            (S::Prepared, I::Drain) => return destroy,
            (S::Prepared, I::HostRebooted) => {
                if kind == PoolKind::Prewarm {
                    return destroy;
                }
                (Some(S::Prepared), None)
            }
            (S::RestoringToStop, I::RestoreDone) => (Some(S::Warm), None),
            (S::RestoringToStop, I::Drain | I::Failed | I::HostRebooted) => return destroy,
            (S::RestoringToHandOut, I::RestoreDone) => (Some(S::CheckedOut), None),
            (S::RestoringToHandOut, I::Drain) => (Some(S::RestoringToHandOut), None),
            (S::RestoringToHandOut, I::Failed | I::HostRebooted) => return destroy,
            (S::Warm, I::Checkout) => (Some(S::CheckedOut), Some(A::Continue(id))),
            (S::Warm, I::Drain | I::Failed | I::HostRebooted) => return destroy,
            (S::CheckedOut, I::Return | I::Failed | I::HostRebooted) => return destroy,
            (S::CheckedOut, I::Drain) => (Some(S::CheckedOut), None),
            (S::Destroying, I::Destroyed) => (None, None),
            (S::Destroying, I::Drain) => (Some(S::Destroying), None),
            (S::Destroying, I::Failed | I::HostRebooted) => return destroy,
            _ => return None,
        })
    }

    #[test]
    fn transition_table_is_exactly_as_written() {
        let mut valid = 0;
        for kind in [PoolKind::Prewarm, PoolKind::Durable, PoolKind::DurablePrewarm] {
            for state in ALL_STATES {
                for input in ALL_INPUTS {
                    let got = step(kind, 7, state, input);
                    match expected(kind, state, input) {
                        Some((next, action)) => {
                            assert_eq!(got, Ok(Step { next, action }), "{kind:?} {state:?} {input:?}");
                            valid += 1;
                        }
                        None => assert_eq!(
                            got,
                            Err(PoolError::Invalid { slot: 7, state, input }),
                            "{kind:?} {state:?} {input:?}"
                        ),
                    }
                }
            }
        }
        // 28 valid pairs per kind out of 63.
        assert_eq!(valid, 3 * 28);
    }

    #[test]
    fn every_state_accepts_drain_and_reboot() {
        for kind in [PoolKind::Prewarm, PoolKind::Durable, PoolKind::DurablePrewarm] {
            for state in ALL_STATES {
                assert!(step(kind, 1, state, I::Drain).is_ok(), "{kind:?} {state:?}");
                assert!(step(kind, 1, state, I::HostRebooted).is_ok(), "{kind:?} {state:?}");
            }
        }
    }

    fn finish(pool: &mut Pool, actions: &[Action]) {
        for action in actions {
            match action {
                A::Prepare(id) => {
                    let more = pool.apply(*id, I::PrepareDone).unwrap();
                    assert_eq!(more, None);
                }
                A::Restore { slot, .. } => assert_eq!(pool.apply(*slot, I::RestoreDone).unwrap(), None),
                A::Destroy(id) => assert_eq!(pool.apply(*id, I::Destroyed).unwrap(), None),
                A::Continue(_) => {}
            }
        }
    }

    #[test]
    fn prewarm_pool_hands_out_by_sigcont_and_refills() {
        let mut pool = Pool::new("python", PoolKind::Prewarm);
        let actions = pool.warm(2);
        assert_eq!(actions, vec![A::Prepare(1), A::Prepare(2)]);
        finish(&mut pool, &actions);
        let actions = pool.refill();
        assert_eq!(actions, vec![A::Restore { slot: 1, stop: true }, A::Restore { slot: 2, stop: true }]);
        finish(&mut pool, &actions);
        assert_eq!(pool.state(1), Some(S::Warm));

        let (slot, actions) = pool.checkout().unwrap();
        assert_eq!(slot, 1);
        assert_eq!(actions, vec![A::Continue(1), A::Prepare(3)]);
        assert_eq!(pool.state(1), Some(S::CheckedOut));

        let actions = pool.give_back(1).unwrap();
        assert_eq!(actions, vec![A::Destroy(1)]);
        finish(&mut pool, &actions);
        assert_eq!(pool.state(1), None);
    }

    #[test]
    fn durable_pool_restores_on_checkout() {
        let mut pool = Pool::new("python", PoolKind::Durable);
        let actions = pool.warm(1);
        finish(&mut pool, &actions);
        assert_eq!(pool.refill(), vec![], "durable slots stay on disk until asked for");
        let (slot, actions) = pool.checkout().unwrap();
        assert_eq!(actions, vec![A::Restore { slot, stop: false }, A::Prepare(2)]);
        assert_eq!(pool.state(slot), Some(S::RestoringToHandOut));
        pool.apply(slot, I::RestoreDone).unwrap();
        assert_eq!(pool.state(slot), Some(S::CheckedOut));
    }

    #[test]
    fn empty_pool_refuses_checkout() {
        let mut pool = Pool::new("python", PoolKind::Prewarm);
        assert_eq!(pool.checkout(), Err(PoolError::Empty));
        pool.warm(1);
        assert_eq!(pool.checkout(), Err(PoolError::Empty), "a slot still preparing cannot be handed out");
    }

    #[test]
    fn reboot_keeps_durable_slots_and_rewarms_them() {
        let found = [(1, S::Prepared), (2, S::Warm), (3, S::CheckedOut), (4, S::Prepared)];
        let mut pool = Pool::adopt("python", PoolKind::DurablePrewarm, found);
        pool.target = 3;
        let actions = pool.after_reboot();
        assert_eq!(
            actions,
            vec![
                A::Destroy(2),
                A::Destroy(3),
                A::Prepare(5),
                A::Restore { slot: 1, stop: true },
                A::Restore { slot: 4, stop: true },
            ]
        );

        let mut prewarm = Pool::adopt("python", PoolKind::Prewarm, [(1, S::Prepared)]);
        assert_eq!(prewarm.after_reboot(), vec![A::Destroy(1)]);
    }

    #[test]
    fn drain_leaves_checked_out_guests() {
        let mut pool = Pool::adopt("python", PoolKind::Prewarm, [(1, S::Warm), (2, S::CheckedOut), (3, S::Preparing)]);
        pool.target = 3;
        assert_eq!(pool.drain(), vec![A::Destroy(1), A::Destroy(3)]);
        assert_eq!(pool.state(2), Some(S::CheckedOut));
        assert_eq!(pool.target, 0);
        assert_eq!(pool.give_back(2).unwrap(), vec![A::Destroy(2)], "no refill after a drain");
    }

    #[test]
    fn list_json() {
        let pool = Pool::adopt("python", PoolKind::DurablePrewarm, [(1, S::Warm), (2, S::Warm), (3, S::CheckedOut)]);
        assert_eq!(
            pool.to_json(),
            serde_json::json!({
                "template": "python",
                "kind": "durable-prewarm",
                "target": 0,
                "slots": [
                    {"id": 1, "state": "warm"},
                    {"id": 2, "state": "warm"},
                    {"id": 3, "state": "checked-out"},
                ],
                "counts": {"warm": 2, "checked-out": 1},
            })
        );
    }
}
