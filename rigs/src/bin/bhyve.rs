//! `copse-rig-bhyve <rig>`: the bhyve benchmark rigs.
//!
//! Off FreeBSD it refuses before touching anything. On FreeBSD the
//! measurement loop is not written yet (see patches/README.md, operator test
//! plan), so it refuses there too, after printing the plan it would follow.

use std::process::ExitCode;

use copse_rigs::bhyve::{self as rig, Rig};

fn main() -> ExitCode {
    let Some(rig) = std::env::args().nth(1).as_deref().and_then(Rig::parse) else {
        let names: Vec<&str> = rig::ALL.iter().map(|r| r.name()).collect();
        eprintln!("usage: copse-rig-bhyve <{}>", names.join("|"));
        return ExitCode::from(2);
    };
    if let Some(why) = rig::refusal(std::env::consts::OS) {
        eprintln!("{rig}: refusing to run: {why}");
        return ExitCode::from(3);
    }
    eprintln!("{rig}: clock: {}", rig.clock());
    eprintln!(
        "{rig}: the FreeBSD measurement loop is not implemented in this build; follow the operator \
         test plan in patches/README.md. No result file was written."
    );
    ExitCode::from(4)
}
