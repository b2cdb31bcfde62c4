//! What `copse-agent boot` prints once a sandbox is up: init's host pid on
//! the first line, then how long each of its steps took, so the substrate
//! can say where a slow boot went without a debug build or log scraping.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootReport {
    pub init_pid: i32,
    /// Step names (`[a-z_]`) and their times, in the order they ran.
    pub steps: Vec<(String, Duration)>,
}

impl BootReport {
    /// `1234\ncgroups=15 stage=310\n`: times in microseconds.
    pub fn render(&self) -> String {
        format!("{}\n{}\n", self.init_pid, render_steps(&self.steps))
    }

    pub fn parse(printed: &str) -> anyhow::Result<Self> {
        let mut lines = printed.lines();
        let init_pid = lines.next().unwrap_or_default().trim().parse().context("boot printed no init pid")?;
        let steps = parse_steps(lines.next().unwrap_or_default()).context("boot printed bad step times")?;
        Ok(Self { init_pid, steps })
    }
}

/// `root=310 mask=77`: step names and times in microseconds.
pub fn render_steps(steps: &[(String, Duration)]) -> String {
    let fields: Vec<String> = steps.iter().map(|(name, took)| format!("{name}={}", took.as_micros())).collect();
    fields.join(" ")
}

pub fn parse_steps(line: &str) -> anyhow::Result<Vec<(String, Duration)>> {
    let mut steps = Vec::new();
    for field in line.split_whitespace() {
        let Some((name, micros)) = field.split_once('=') else { bail!("a step without a time: {field:?}") };
        // Names end up in a response header.
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
            bail!("a bad step name: {field:?}");
        }
        let micros: u64 = micros.parse().with_context(|| format!("a bad step time: {field:?}"))?;
        steps.push((name.to_string(), Duration::from_micros(micros)));
    }
    Ok(steps)
}

/// Times consecutive steps of one process: each lap is the time since the
/// previous one.
pub struct Laps {
    last: Instant,
    steps: Vec<(String, Duration)>,
}

impl Laps {
    pub fn start() -> Self {
        Self { last: Instant::now(), steps: Vec::new() }
    }

    pub fn lap(&mut self, name: &str) {
        let now = Instant::now();
        self.steps.push((name.to_string(), now - self.last));
        self.last = now;
    }

    /// A lap another process timed parts of: `parts`, then what they leave
    /// of the lap, as `rest`.
    pub fn lap_with_parts(&mut self, parts: Vec<(String, Duration)>, rest: &str) {
        let now = Instant::now();
        let timed: Duration = parts.iter().map(|(_, took)| *took).sum();
        let rest_took = (now - self.last).saturating_sub(timed);
        self.steps.extend(parts);
        self.steps.push((rest.to_string(), rest_took));
        self.last = now;
    }

    pub fn report(self, init_pid: i32) -> BootReport {
        BootReport { init_pid, steps: self.steps }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_reads_back_as_written() {
        let report = BootReport {
            init_pid: 4242,
            steps: vec![("stage".into(), Duration::from_micros(310)), ("userns".into(), Duration::from_micros(77))],
        };
        assert_eq!(report.render(), "4242\nstage=310 userns=77\n");
        assert_eq!(BootReport::parse(&report.render()).unwrap(), report);
    }

    #[test]
    fn a_bare_pid_is_a_report_without_steps() {
        assert_eq!(BootReport::parse("17\n").unwrap(), BootReport { init_pid: 17, steps: vec![] });
    }

    #[test]
    fn garbage_is_refused() {
        assert!(BootReport::parse("").is_err());
        assert!(BootReport::parse("12\nstage\n").is_err());
        assert!(BootReport::parse("12\nstage=fast\n").is_err());
        assert!(BootReport::parse("12\nSt\u{e4}ge=5\n").is_err());
        assert!(BootReport::parse("12\n=5\n").is_err());
    }

    #[test]
    fn parts_timed_elsewhere_leave_the_rest_of_their_lap() {
        let mut laps = Laps::start();
        std::thread::sleep(Duration::from_millis(3));
        laps.lap_with_parts(vec![("root".into(), Duration::from_millis(1))], "agent");
        let report = laps.report(1);
        assert_eq!(report.steps[0], ("root".to_string(), Duration::from_millis(1)));
        assert_eq!(report.steps[1].0, "agent");
        assert!(report.steps[1].1 >= Duration::from_millis(2));
        assert_eq!(parse_steps(&render_steps(&report.steps)).unwrap().len(), 2);
    }

    #[test]
    fn laps_are_consecutive() {
        let mut laps = Laps::start();
        std::thread::sleep(Duration::from_millis(2));
        laps.lap("first");
        laps.lap("second");
        let report = laps.report(1);
        assert_eq!(report.steps.len(), 2);
        assert!(report.steps[0].1 >= Duration::from_millis(2));
        assert!(report.steps[1].1 < Duration::from_millis(2));
    }
}
