//! Where one sandbox's create spent its time, step by step, so that a
//! slower create can be taken apart from its own response (and a
//! benchmark's samples) rather than from debug logs.

use std::time::{Duration, Instant};

/// Named durations in the order the steps ran. Names are short tokens
/// (`[a-z_]`), as `Server-Timing` metric names must be.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Phases(Vec<(String, Duration)>);

impl Phases {
    /// Notes that step `name` took `took`; a repeated name adds up.
    pub fn note(&mut self, name: &str, took: Duration) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some((_, total)) => *total += took,
            None => self.0.push((name.to_string(), took)),
        }
    }

    /// Runs `step`, noting its time as `name`.
    pub fn time<T>(&mut self, name: &str, step: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let out = step();
        self.note(name, started.elapsed());
        out
    }

    /// Notes each of `steps`, its name prefixed with `prefix`.
    pub fn extend_prefixed<S: AsRef<str>>(&mut self, prefix: &str, steps: impl IntoIterator<Item = (S, Duration)>) {
        for (name, took) in steps {
            self.note(&format!("{prefix}{}", name.as_ref()), took);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, Duration)> {
        self.0.iter().map(|(n, d)| (n.as_str(), *d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_keep_their_order_and_repeats_add_up() {
        let mut phases = Phases::default();
        phases.note("disk", Duration::from_millis(2));
        phases.note("cgroups", Duration::from_millis(1));
        phases.note("disk", Duration::from_millis(3));
        let mut jail = Phases::default();
        jail.note("userns", Duration::from_micros(400));
        phases.extend_prefixed("jail_", jail.0);
        let seen: Vec<_> = phases.iter().collect();
        assert_eq!(
            seen,
            [
                ("disk", Duration::from_millis(5)),
                ("cgroups", Duration::from_millis(1)),
                ("jail_userns", Duration::from_micros(400))
            ]
        );
    }

    #[test]
    fn time_returns_what_the_step_returned() {
        let mut phases = Phases::default();
        assert_eq!(phases.time("work", || 7), 7);
        assert_eq!(phases.iter().map(|(n, _)| n).collect::<Vec<_>>(), ["work"]);
    }
}
