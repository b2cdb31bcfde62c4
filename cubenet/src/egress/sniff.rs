//! The name a connection asks for, read from its first bytes without
//! consuming them: the HTTP/1 `Host` header or the TLS ClientHello's SNI.

/// What the first bytes say so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniffed {
    /// Not enough bytes yet to tell.
    NeedMore,
    /// The name the client asked for.
    Name(String),
    /// A complete HTTP head or ClientHello without a name, or another
    /// protocol: the destination address alone decides.
    Nameless,
}

/// The first bytes of a connection to port 80 or 443 (either protocol on
/// either port: a sandbox chooses).
pub fn sniff(buf: &[u8]) -> Sniffed {
    match buf.first() {
        None => Sniffed::NeedMore,
        Some(0x16) => tls_sni(buf),
        Some(_) => http_host(buf),
    }
}

/// The `Host` header of an HTTP/1 request head, without its port.
pub fn http_host(buf: &[u8]) -> Sniffed {
    let Some(end) = find(buf, b"\r\n\r\n") else {
        return Sniffed::NeedMore;
    };
    let Ok(head) = std::str::from_utf8(&buf[..end]) else { return Sniffed::Nameless };
    let mut hosts = head.split("\r\n").skip(1).filter_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.trim().eq_ignore_ascii_case("host").then(|| value.trim())
    });
    // Two Host headers are a smuggling attempt: the proxy and the upstream
    // might each pick a different one.
    match (hosts.next(), hosts.next()) {
        (Some(host), None) => match strip_port(host) {
            Some(name) if !name.is_empty() => Sniffed::Name(name.to_ascii_lowercase()),
            _ => Sniffed::Nameless,
        },
        _ => Sniffed::Nameless,
    }
}

fn strip_port(host: &str) -> Option<&str> {
    if host.starts_with('[') {
        // An IPv6 literal names no host.
        return None;
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => Some(name),
        Some(_) => None,
        None => Some(host),
    }
}

/// The server_name of a TLS ClientHello, which may span several records.
pub fn tls_sni(buf: &[u8]) -> Sniffed {
    // Reassemble the handshake bytes of consecutive handshake records.
    let mut handshake = Vec::new();
    let mut rest = buf;
    loop {
        if rest.len() < 5 {
            break;
        }
        if rest[0] != 0x16 {
            return Sniffed::Nameless;
        }
        let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
        if rest.len() < 5 + len {
            handshake.extend_from_slice(&rest[5..]);
            break;
        }
        handshake.extend_from_slice(&rest[5..5 + len]);
        rest = &rest[5 + len..];
    }
    if handshake.len() < 4 {
        return Sniffed::NeedMore;
    }
    if handshake[0] != 0x01 {
        return Sniffed::Nameless;
    }
    let len = (usize::from(handshake[1]) << 16) | (usize::from(handshake[2]) << 8) | usize::from(handshake[3]);
    if handshake.len() < 4 + len {
        return Sniffed::NeedMore;
    }
    match client_hello_sni(&handshake[4..4 + len]) {
        Some(name) => Sniffed::Name(name),
        None => Sniffed::Nameless,
    }
}

fn client_hello_sni(hello: &[u8]) -> Option<String> {
    let mut r = Reader(hello);
    r.take(2 + 32)?; // version, random
    let session = r.u8()?;
    r.take(session.into())?;
    let suites = r.u16()?;
    r.take(suites.into())?;
    let compression = r.u8()?;
    r.take(compression.into())?;
    let mut extensions = Reader(r.block16()?);
    let mut found = None;
    while !extensions.0.is_empty() {
        let kind = extensions.u16()?;
        let body = extensions.block16()?;
        if kind != 0 {
            continue;
        }
        // Two server_name extensions are malformed (RFC 8446 4.2).
        if found.is_some() {
            return None;
        }
        let mut list = Reader(body);
        let mut names = Reader(list.block16()?);
        while !names.0.is_empty() {
            let name_type = names.u8()?;
            let name = names.block16()?;
            if name_type == 0 {
                let name = std::str::from_utf8(name).ok()?;
                found = Some(name.trim_end_matches('.').to_ascii_lowercase());
                break;
            }
        }
    }
    found.filter(|n| !n.is_empty())
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    /// A vector with a 16-bit length prefix.
    fn block16(&mut self) -> Option<&'a [u8]> {
        let len = self.u16()?;
        self.take(len.into())
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ClientHello naming `name`, split into records of at most
    /// `record` bytes.
    pub(crate) fn client_hello(name: Option<&str>, record: usize) -> Vec<u8> {
        let mut ext = Vec::new();
        if let Some(name) = name {
            let n = name.as_bytes();
            let mut list = vec![0u8];
            list.extend((n.len() as u16).to_be_bytes());
            list.extend(n);
            let mut body = (list.len() as u16).to_be_bytes().to_vec();
            body.extend(list);
            ext.extend(0u16.to_be_bytes());
            ext.extend((body.len() as u16).to_be_bytes());
            ext.extend(body);
        }
        // An unrelated extension after it (supported_groups).
        ext.extend([0x00, 0x0a, 0x00, 0x04, 0x00, 0x02, 0x00, 0x1d]);
        let mut hello = vec![0x03, 0x03];
        hello.extend([7u8; 32]);
        hello.extend([0, 0x00, 0x02, 0x13, 0x01, 0x01, 0x00]);
        hello.extend((ext.len() as u16).to_be_bytes());
        hello.extend(ext);
        let mut handshake = vec![0x01, 0, 0, 0];
        handshake[1..4].copy_from_slice(&(hello.len() as u32).to_be_bytes()[1..]);
        handshake.extend(hello);
        handshake
            .chunks(record)
            .flat_map(|chunk| {
                let mut r = vec![0x16, 0x03, 0x01];
                r.extend((chunk.len() as u16).to_be_bytes());
                r.extend(chunk);
                r
            })
            .collect()
    }

    #[test]
    fn the_sni_is_read_across_records_and_only_once_complete() {
        for record in [16, 1000] {
            let hello = client_hello(Some("API.Example.com"), record);
            assert_eq!(sniff(&hello), Sniffed::Name("api.example.com".into()), "records of {record}");
            for cut in [1, 5, 9, hello.len() - 1] {
                assert_eq!(sniff(&hello[..cut]), Sniffed::NeedMore, "cut at {cut} of records of {record}");
            }
        }
        assert_eq!(sniff(&client_hello(None, 1000)), Sniffed::Nameless);
        let mut garbage = client_hello(Some("a.test"), 1000);
        garbage[5] = 0x02;
        assert_eq!(sniff(&garbage), Sniffed::Nameless, "not a ClientHello");
    }

    #[test]
    fn the_host_header_is_read_without_its_port() {
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: Allowed.test:8080\r\nA: b\r\n\r\n"),
            Sniffed::Name("allowed.test".into())
        );
        assert_eq!(sniff(b"GET / HTTP/1.1\r\nhost:x.test\r\n\r\nbody"), Sniffed::Name("x.test".into()));
        assert_eq!(sniff(b"GET / HTTP/1.1\r\nHost: x.test\r\n"), Sniffed::NeedMore);
        assert_eq!(sniff(b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n"), Sniffed::Nameless);
        assert_eq!(sniff(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n"), Sniffed::Nameless);
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: allowed.test\r\nHost: evil.test\r\n\r\n"),
            Sniffed::Nameless,
            "two Host headers name nothing"
        );
    }
}
