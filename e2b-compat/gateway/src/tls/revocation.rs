//! The cluster CA's revocation list as a running node holds it. Both ends
//! of the node's TLS (the peer listener's client check and the forwarding
//! client's server check) ask one [`Revocations`], so a newer list takes
//! effect for the next handshake without a restart; connections already
//! open are checked again by whoever holds them ([`Revocations::changes`],
//! [`Revocations::trusts_peer`]).
//!
//! A list is adopted only if the CA signed it and its CRL number is above
//! the one held: whoever can write where lists travel (the shared
//! database) can neither forge one nor bring back an older one to un-revoke
//! a certificate.

use std::sync::{Arc, RwLock};

use anyhow::{Context, bail};
use tokio::sync::watch;
use tokio_rustls::rustls::client::WebPkiServerVerifier;
use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, CertificateRevocationListDer, ServerName, UnixTime};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::{DigitallySignedStruct, DistinguishedName, Error, RootCertStore, SignatureScheme};
use x509_parser::num_bigint::BigUint;

pub struct Revocations {
    ca: CertificateDer<'static>,
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
    /// The CA's names, which no list changes: what the listener offers
    /// clients as the issuers it accepts.
    hints: Vec<DistinguishedName>,
    held: RwLock<Held>,
    changed: watch::Sender<u64>,
}

/// The list in force and the verifiers made from it.
struct Held {
    /// The adopted list's CRL number; `None` before any list.
    number: Option<BigUint>,
    pem: String,
    clients: Arc<dyn ClientCertVerifier>,
    servers: Arc<dyn ServerCertVerifier>,
}

impl Revocations {
    /// With no list: every certificate of the CA is good until one comes.
    pub fn new(ca: CertificateDer<'static>, provider: Arc<CryptoProvider>) -> anyhow::Result<Arc<Self>> {
        let mut roots = RootCertStore::empty();
        roots.add(ca.clone()).context("the cluster CA certificate")?;
        let roots = Arc::new(roots);
        let (clients, servers) = verifiers(&roots, &provider, Vec::new())?;
        let hints = clients.root_hint_subjects().to_vec();
        let held = Held { number: None, pem: String::new(), clients, servers };
        Ok(Arc::new(Self { ca, roots, provider, hints, held: RwLock::new(held), changed: watch::Sender::new(0) }))
    }

    /// Takes `pem` as the list in force if the CA signed it and it is newer
    /// than the one held. `Ok(false)`: it is the held list or an older one.
    pub fn adopt(&self, pem: &str) -> anyhow::Result<bool> {
        // Offered every heartbeat: the list in force needs no checking again.
        let held = self.held.read().expect("revocations lock");
        if held.number.is_some() && held.pem == pem {
            return Ok(false);
        }
        drop(held);
        let der =
            CertificateRevocationListDer::from_pem_slice(pem.as_bytes()).context("parsing the revocation list")?;
        let (_, ca) = x509_parser::parse_x509_certificate(&self.ca).context("parsing the cluster CA certificate")?;
        let (_, crl) = x509_parser::parse_x509_crl(&der).context("parsing the revocation list")?;
        if crl.verify_signature(ca.public_key()).is_err() {
            bail!("the revocation list was not signed by the cluster CA");
        }
        let number = crl.crl_number().cloned().context("the revocation list has no CRL number")?;
        if self.held.read().expect("revocations lock").number.as_ref().is_some_and(|held| *held >= number) {
            return Ok(false);
        }
        let (clients, servers) = verifiers(&self.roots, &self.provider, vec![der.clone()])?;
        {
            let mut held = self.held.write().expect("revocations lock");
            // Another adopt may have won meanwhile.
            if held.number.as_ref().is_some_and(|n| *n >= number) {
                return Ok(false);
            }
            *held = Held { number: Some(number), pem: pem.to_string(), clients, servers };
        }
        self.changed.send_modify(|generation| *generation += 1);
        Ok(true)
    }

    /// The list in force, as adopted (empty before any).
    pub fn pem(&self) -> String {
        self.held.read().expect("revocations lock").pem.clone()
    }

    /// Moves each time a newer list is adopted.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Whether the certificates a connected peer showed still pass, under
    /// the list in force now.
    pub fn trusts_peer(&self, chain: &[CertificateDer<'_>]) -> bool {
        let Some((end, intermediates)) = chain.split_first() else {
            return false;
        };
        self.clients().verify_client_cert(end, intermediates, UnixTime::now()).is_ok()
    }

    pub fn client_verifier(self: &Arc<Self>) -> Arc<dyn ClientCertVerifier> {
        Arc::new(Current(self.clone()))
    }

    pub fn server_verifier(self: &Arc<Self>) -> Arc<dyn ServerCertVerifier> {
        Arc::new(Current(self.clone()))
    }

    fn clients(&self) -> Arc<dyn ClientCertVerifier> {
        self.held.read().expect("revocations lock").clients.clone()
    }

    fn servers(&self) -> Arc<dyn ServerCertVerifier> {
        self.held.read().expect("revocations lock").servers.clone()
    }
}

/// WebPKI verifiers of the CA's certificates with `crls`. The list's
/// issuer is the CA, which is no one's certificate to revoke: only a
/// node's own certificate is looked up in it.
fn verifiers(
    roots: &Arc<RootCertStore>,
    provider: &Arc<CryptoProvider>,
    crls: Vec<CertificateRevocationListDer<'static>>,
) -> anyhow::Result<(Arc<dyn ClientCertVerifier>, Arc<dyn ServerCertVerifier>)> {
    let clients = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .with_crls(crls.clone())
        .only_check_end_entity_revocation()
        .build()?;
    let servers = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
        .with_crls(crls)
        .only_check_end_entity_revocation()
        .build()?;
    Ok((clients, servers))
}

/// A verifier that asks whichever list is in force at each handshake.
struct Current(Arc<Revocations>);

impl std::fmt::Debug for Current {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the cluster CA with its current revocation list")
    }
}

impl ClientCertVerifier for Current {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.0.hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        self.0.clients().verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        ClientCertVerifier::verify_tls12_signature(self.0.clients().as_ref(), message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        ClientCertVerifier::verify_tls13_signature(self.0.clients().as_ref(), message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        ClientCertVerifier::supported_verify_schemes(self.0.clients().as_ref())
    }
}

impl ServerCertVerifier for Current {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        self.0.servers().verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        ServerCertVerifier::verify_tls12_signature(self.0.servers().as_ref(), message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        ServerCertVerifier::verify_tls13_signature(self.0.servers().as_ref(), message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        ServerCertVerifier::supported_verify_schemes(self.0.servers().as_ref())
    }
}
