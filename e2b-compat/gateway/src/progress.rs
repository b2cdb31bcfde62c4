//! Progress of long operations (template builds) for a person watching: a
//! spinner on a terminal, plain step lines in logs.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};

use indicatif::{ProgressBar, ProgressStyle};

pub struct Reporter {
    bar: Option<ProgressBar>,
    lines: AtomicU64,
}

impl Reporter {
    pub fn new(title: &str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} {prefix} [{elapsed}] {wide_msg}").expect("valid template"),
            );
            bar.set_prefix(title.to_string());
            bar.enable_steady_tick(std::time::Duration::from_millis(120));
            bar
        });
        if bar.is_none() {
            eprintln!("{title}");
        }
        Self { bar, lines: AtomicU64::new(0) }
    }

    /// Step lines ("[2/4] …", "template … ready") always show; tool output
    /// updates the spinner, or every 25th line in a log.
    pub fn line(&self, line: &str) {
        let is_step = line.starts_with('[') || line.starts_with("template ");
        match &self.bar {
            Some(bar) if is_step => bar.println(line),
            Some(bar) => bar.set_message(line.to_string()),
            None => {
                let n = self.lines.fetch_add(1, Ordering::Relaxed);
                if is_step || n.is_multiple_of(25) {
                    eprintln!("  {line}");
                }
            }
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
