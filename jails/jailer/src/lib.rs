//! What runs inside a sandbox on the substrate's side: the boot sequence of
//! `copse-agent boot` (the sandbox's first process) and the confinement of
//! every process the agent starts for a user.
//!
//! The in-sandbox agent links this crate and nothing else of the
//! substrate's, so it carries no network, backend or router code. The
//! backends that start a sandbox import from here what both sides of a
//! boot must agree on ([`handoff`], and on Linux the boot plan).

pub mod confine;
pub mod credentials;
pub mod handoff;
mod syscall;

/// Also used by the backends for their own raw calls.
pub use syscall::check;

#[cfg(target_os = "linux")]
pub mod linux {
    //! Linux: the sandbox's namespaces, root and init are built from inside.
    pub mod boot;
    pub mod boot_report;
    pub(crate) mod confine;
    pub(crate) mod credentials;
    mod seccomp;
}

#[cfg(target_os = "freebsd")]
mod freebsd {
    //! FreeBSD: the host builds the jail; inside, the agent only serves.
    pub mod boot;
    pub mod confine;
    pub(crate) mod credentials;
}

/// Entry point of `copse-agent boot`, run by the substrate as the first
/// process of a new sandbox: finishes the sandbox's set-up from inside, then
/// (on FreeBSD here, on Linux through [`init_agent`]) calls `serve` with the
/// listening socket the gateway will connect to.
/// Exits the process; never returns.
pub fn boot_agent(serve: impl FnOnce(std::os::unix::net::UnixListener) -> anyhow::Result<()>) -> ! {
    #[cfg(target_os = "linux")]
    {
        drop(serve);
        linux::boot::run_from_stdin()
    }
    #[cfg(target_os = "freebsd")]
    {
        freebsd::boot::run(serve)
    }
}

/// Entry point of `copse-agent criu-action`: CRIU's action script for a
/// sandbox's restore (Linux only; see `linux::boot::criu_action`).
pub fn criu_action() -> anyhow::Result<()> {
    #[cfg(target_os = "linux")]
    {
        linux::boot::criu_action()
    }
    #[cfg(not(target_os = "linux"))]
    {
        anyhow::bail!("criu-action runs only on Linux")
    }
}

/// Entry point of `copse-agent boot --init`: the sandbox's init once it runs
/// from the agent binary inside the sandbox (Linux only; see
/// `linux::boot`). Never returns.
pub fn init_agent(serve: impl FnOnce(std::os::unix::net::UnixListener) -> anyhow::Result<()>) -> ! {
    #[cfg(target_os = "linux")]
    {
        linux::boot::run_init(serve)
    }
    #[cfg(target_os = "freebsd")]
    {
        drop(serve);
        eprintln!("copse boot: --init is the second stage of a Linux sandbox's init");
        std::process::exit(2)
    }
}
