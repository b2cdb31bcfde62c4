//! Header names and fixed values of the envd API, as the SDK, the gateway
//! and the agent spell them.

/// The sandbox's envd access token (`envdAccessToken` of a create response).
pub const ACCESS_TOKEN: &str = "x-access-token";
/// The sandbox's traffic token (`trafficAccessToken` of a create response),
/// which requests to its ports need when it does not allow public traffic.
pub const TRAFFIC_ACCESS_TOKEN: &str = "e2b-traffic-access-token";
/// Set by the agent on a request it relays to an in-sandbox port when the
/// caller presented the access token (which the agent strips): how the
/// code interpreter knows its caller is authorised without ever seeing the
/// token. A caller's own value is always removed first.
pub const CALLER_AUTHENTICATED: &str = "x-copse-caller-authenticated";
/// Set by the gateway, and only by it, on a request for a port listed in
/// the sandbox's `network.httpsPorts`: the agent speaks TLS to that port.
/// The gateway removes a client's copy; the agent removes it before
/// relaying, so the in-sandbox server never sees it.
pub const PORT_TLS: &str = "x-copse-port-tls";
/// Which sandbox port a request through the gateway is for.
pub const SANDBOX_PORT: &str = "e2b-sandbox-port";
/// Which sandbox a request through the gateway is for.
pub const SANDBOX_ID: &str = "e2b-sandbox-id";
/// The port E2B's SDK uses for envd, i.e. the agent.
pub const AGENT_PORT: u16 = 49983;

/// Content type of unary Connect calls with the JSON codec.
pub const CONTENT_TYPE_UNARY: &str = "application/json";
/// Content type of streaming Connect calls with the JSON codec.
pub const CONTENT_TYPE_STREAM: &str = "application/connect+json";
/// The Connect protocol version header and the only version there is.
pub const CONNECT_PROTOCOL_VERSION: &str = "connect-protocol-version";
pub const CONNECT_PROTOCOL_VERSION_1: &str = "1";
