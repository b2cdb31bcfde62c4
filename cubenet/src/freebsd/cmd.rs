//! One step of a FreeBSD plan: a command line and its input, as plain data
//! the plans of [`super::pf`] and [`super::vnet`] return and a
//! [`super::jailnet::Runner`] runs.

use std::fmt;

/// One command line (absolute program first) and what it reads on stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmd {
    pub argv: Vec<String>,
    pub stdin: Option<String>,
}

impl Cmd {
    pub fn new(argv: &[&str]) -> Self {
        Self { argv: argv.iter().map(|s| s.to_string()).collect(), stdin: None }
    }

    pub fn stdin(mut self, input: String) -> Self {
        self.stdin = Some(input);
        self
    }
}

impl fmt::Display for Cmd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.stdin {
            None => write!(f, "{}", self.argv.join(" ")),
            Some(input) => write!(f, "{} <<EOF\n{input}EOF", self.argv.join(" ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_render_with_their_input() {
        assert_eq!(
            Cmd::new(&["/sbin/pfctl", "-a", "x", "-f", "-"]).stdin("pass\n".into()).to_string(),
            "/sbin/pfctl -a x -f - <<EOF\npass\nEOF"
        );
    }
}
