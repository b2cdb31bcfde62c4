//! Where the code interpreter asks the agent for kernels, and as whom it
//! runs (the agent's side is `copse_agent::kernels`; the interpreter's is
//! `AgentLauncher` in `copse_interpreter.py`, which repeats these names).

/// The account the code interpreter runs as inside a sandbox: not `user`,
/// so code running as `user` cannot signal it, trace it, read its state or
/// take its port.
pub const INTERPRETER_USER: &str = "copse-interp";

/// Linux: the agent's kernel socket, in the abstract namespace of the
/// sandbox's network namespace.
pub const SOCKET_ABSTRACT_NAME: &[u8] = b"copse-agent-kernels";

/// Elsewhere (FreeBSD jails): the socket file, in a root-owned directory.
pub const SOCKET_PATH: &str = "/var/run/copse-agent-kernels.sock";
