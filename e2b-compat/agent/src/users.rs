//! Sandbox users, read straight from `/etc/passwd` and `/etc/group`.
//!
//! The agent is a static binary running inside an arbitrary template image,
//! so it must not go through NSS (`getpwnam`): it parses the files itself.
//! They are re-read on every lookup because users can be added at runtime
//! (`useradd` in a command) and the files are tiny.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One account, with everything needed to run a process as it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    /// Primary group first, then supplementary groups from `/etc/group`.
    pub groups: Vec<u32>,
}

/// A snapshot of the account databases under one `etc` directory.
#[derive(Debug, Default, Clone)]
pub struct UserDb {
    users: Vec<PasswdEntry>,
    groups: Vec<GroupEntry>,
}

#[derive(Debug, Clone)]
struct PasswdEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

#[derive(Debug, Clone)]
struct GroupEntry {
    name: String,
    gid: u32,
    members: Vec<String>,
}

impl UserDb {
    /// Reads `<etc>/passwd` and `<etc>/group`; missing files mean no entries.
    pub fn load(etc: &Path) -> Self {
        let read = |name: &str| std::fs::read_to_string(etc.join(name)).unwrap_or_default();
        Self::parse(&read("passwd"), &read("group"))
    }

    pub fn parse(passwd: &str, group: &str) -> Self {
        let users = records(passwd)
            .filter_map(|f| {
                Some(PasswdEntry {
                    name: f.first()?.to_string(),
                    uid: f.get(2)?.parse().ok()?,
                    gid: f.get(3)?.parse().ok()?,
                    home: f.get(5)?.to_string(),
                })
            })
            .collect();
        let groups = records(group)
            .filter_map(|f| {
                Some(GroupEntry {
                    name: f.first()?.to_string(),
                    gid: f.get(2)?.parse().ok()?,
                    members: f
                        .get(3)
                        .map(|m| m.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect())
                        .unwrap_or_default(),
                })
            })
            .collect();
        Self { users, groups }
    }

    pub fn user(&self, name: &str) -> Option<User> {
        let e = self.users.iter().find(|u| u.name == name)?;
        let mut groups = vec![e.gid];
        groups.extend(
            self.groups.iter().filter(|g| g.gid != e.gid && g.members.iter().any(|m| m == name)).map(|g| g.gid),
        );
        let home = if e.home.is_empty() { "/".into() } else { PathBuf::from(&e.home) };
        Some(User { name: e.name.clone(), uid: e.uid, gid: e.gid, home, groups })
    }

    /// Owner and group names for `ls -l`-style output; numeric when unknown.
    pub fn names(&self) -> OwnerNames {
        OwnerNames {
            users: self.users.iter().rev().map(|u| (u.uid, u.name.clone())).collect(),
            groups: self.groups.iter().rev().map(|g| (g.gid, g.name.clone())).collect(),
        }
    }
}

/// Reverse lookup tables (id → first name listed for it).
#[derive(Debug, Default, Clone)]
pub struct OwnerNames {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl OwnerNames {
    pub fn user(&self, uid: u32) -> String {
        self.users.get(&uid).cloned().unwrap_or_else(|| uid.to_string())
    }
    pub fn group(&self, gid: u32) -> String {
        self.groups.get(&gid).cloned().unwrap_or_else(|| gid.to_string())
    }
}

/// Colon-separated records, skipping blanks and comments.
fn records(text: &str) -> impl Iterator<Item = Vec<&str>> {
    text.lines().map(str::trim_end).filter(|l| !l.is_empty() && !l.starts_with('#')).map(|l| l.split(':').collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        # comment\n\
        user:x:1000:1000::/home/user:/bin/bash\n\
        broken:x:notanumber:1:::\n";
    const GROUP: &str = "root:x:0:\nuser:x:1000:\nsudo:x:27:user,other\ndocker:x:999:other\n";

    #[test]
    fn finds_users_with_supplementary_groups() {
        let db = UserDb::parse(PASSWD, GROUP);
        let u = db.user("user").unwrap();
        assert_eq!((u.uid, u.gid), (1000, 1000));
        assert_eq!(u.home, PathBuf::from("/home/user"));
        assert_eq!(u.groups, vec![1000, 27]);
        assert_eq!(db.user("root").unwrap().groups, vec![0]);
        assert!(db.user("broken").is_none());
        assert!(db.user("nobody").is_none());
    }

    #[test]
    fn names_fall_back_to_numbers() {
        let names = UserDb::parse(PASSWD, GROUP).names();
        assert_eq!(names.user(1000), "user");
        assert_eq!(names.group(27), "sudo");
        assert_eq!(names.user(4242), "4242");
    }
}
