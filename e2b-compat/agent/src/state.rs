//! The agent's shared state: the settings `/init` can change, the user
//! database location, running processes and file watchers.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use crate::AgentConfig;
use crate::filesystem::watch::Watchers;
use crate::process::Processes;
use crate::process::spawn::Launcher;
use crate::users::{User, UserDb};

/// Settings handed over by the orchestrator, mutable through `/init`.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    pub access_token: Option<String>,
    pub env_vars: HashMap<String, String>,
    pub default_user: String,
    /// Where a process started without a cwd runs (envd's
    /// `defaultWorkdir`); the user's home when unset or missing.
    pub default_workdir: Option<String>,
}

pub struct AgentState {
    settings: RwLock<Settings>,
    etc_dir: PathBuf,
    pub processes: Processes,
    pub watchers: Watchers,
    pub launcher: Launcher,
}

pub type SharedState = Arc<AgentState>;

impl AgentState {
    pub fn new(config: AgentConfig) -> anyhow::Result<SharedState> {
        let launcher = Launcher::new(config.confine)?;
        Ok(Arc::new(Self {
            settings: RwLock::new(Settings {
                access_token: config.access_token.filter(|t| !t.is_empty()),
                env_vars: config.env_vars,
                default_user: config.default_user,
                default_workdir: None,
            }),
            etc_dir: config.etc_dir,
            processes: Processes::default(),
            watchers: Watchers::default(),
            launcher,
        }))
    }

    pub fn settings(&self) -> Settings {
        self.settings.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn update_settings(&self, f: impl FnOnce(&mut Settings)) {
        f(&mut self.settings.write().unwrap_or_else(|e| e.into_inner()));
    }

    pub fn access_token(&self) -> Option<String> {
        self.settings.read().unwrap_or_else(|e| e.into_inner()).access_token.clone()
    }

    pub fn user_db(&self) -> UserDb {
        UserDb::load(&self.etc_dir)
    }

    /// Looks up `name`, or the default user when `None`/empty.
    pub fn user(&self, name: Option<&str>) -> Result<User, String> {
        let name = match name.filter(|n| !n.is_empty()) {
            Some(n) => n.to_string(),
            None => self.settings().default_user,
        };
        self.user_db().user(&name).ok_or_else(|| format!("error looking up user '{name}': unknown user"))
    }
}
