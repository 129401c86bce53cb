//! What kind of private key a PEM file holds ("RSA key of 2432 bits", "ECDSA P-384 key"),
//! read from its DER structure, so that a key the TLS library refuses is named in the error.
//!
//! rustls with the ring provider signs with RSA keys of 2048, 3072 and 4096 bits only: ring
//! 0.17 takes moduli of 2048 to 4096 bits whose primes are each a multiple of 512 bits long
//! (so a 2432-bit key, which GnuTLS and OpenSSL use, is refused), ECDSA keys on P-256 and
//! P-384, and Ed25519 keys. This module only describes keys; it signs nothing.

use rustls::pki_types::PrivateKeyDer;

/// The RSA modulus sizes ring signs with.
pub(crate) const RSA_BITS_SIGNED: [u32; 3] = [2048, 3072, 4096];

/// One DER element: its tag and contents.
struct Element<'a> {
    tag: u8,
    contents: &'a [u8],
}

/// Reads DER elements one after another from `bytes`.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn next(&mut self) -> Option<Element<'a>> {
        let (&tag, rest) = self.bytes.split_first()?;
        let (&first, mut rest) = rest.split_first()?;
        let length = if first < 0x80 {
            usize::from(first)
        } else {
            let count = usize::from(first & 0x7f);
            if count == 0 || count > 4 || rest.len() < count {
                return None;
            }
            let (length_bytes, after) = rest.split_at(count);
            rest = after;
            length_bytes
                .iter()
                .fold(0usize, |length, &byte| (length << 8) | usize::from(byte))
        };
        if rest.len() < length {
            return None;
        }
        let (contents, after) = rest.split_at(length);
        self.bytes = after;
        Some(Element { tag, contents })
    }
}

const SEQUENCE: u8 = 0x30;
const INTEGER: u8 = 0x02;
const OCTET_STRING: u8 = 0x04;
const OBJECT_IDENTIFIER: u8 = 0x06;

// Object identifiers, DER-encoded contents.
const RSA_ENCRYPTION: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01];
const RSASSA_PSS: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0a];
const EC_PUBLIC_KEY: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
const P256: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
const P384: &[u8] = &[0x2b, 0x81, 0x04, 0x00, 0x22];
const P521: &[u8] = &[0x2b, 0x81, 0x04, 0x00, 0x23];
const ED25519: &[u8] = &[0x2b, 0x65, 0x70];
const ED448: &[u8] = &[0x2b, 0x65, 0x71];

/// The contents of the SEQUENCE that `der` is.
fn sequence(der: &[u8]) -> Option<Reader<'_>> {
    let element = Reader { bytes: der }.next()?;
    (element.tag == SEQUENCE).then_some(Reader {
        bytes: element.contents,
    })
}

/// Bits of an RSA modulus from a PKCS#1 RSAPrivateKey.
fn rsa_bits(pkcs1: &[u8]) -> Option<usize> {
    let mut fields = sequence(pkcs1)?;
    let _version = fields.next().filter(|element| element.tag == INTEGER)?;
    let modulus = fields.next().filter(|element| element.tag == INTEGER)?;
    let digits = match modulus.contents {
        [0, rest @ ..] => rest,
        all => all,
    };
    let (&top, _) = digits.split_first()?;
    Some(digits.len() * 8 - top.leading_zeros() as usize)
}

fn curve_name(oid: &[u8]) -> &'static str {
    match oid {
        P256 => "P-256",
        P384 => "P-384",
        P521 => "P-521",
        _ => "an unknown curve",
    }
}

/// "RSA key of 2432 bits", "ECDSA P-256 key", "Ed25519 key", or "key of an unknown type".
pub(crate) fn describe(key: &PrivateKeyDer<'_>) -> String {
    let described = match key {
        PrivateKeyDer::Pkcs1(der) => rsa_bits(der.secret_pkcs1_der()).map(rsa),
        PrivateKeyDer::Sec1(der) => sec1_curve(der.secret_sec1_der()),
        PrivateKeyDer::Pkcs8(der) => pkcs8(der.secret_pkcs8_der()),
        _ => None,
    };
    described.unwrap_or_else(|| "key of an unknown type".to_owned())
}

fn rsa(bits: usize) -> String {
    format!("RSA key of {bits} bits")
}

/// The curve of a SEC1 ECPrivateKey (its optional parameters, else its private key's size).
fn sec1_curve(der: &[u8]) -> Option<String> {
    let mut fields = sequence(der)?;
    let _version = fields.next()?;
    let private = fields
        .next()
        .filter(|element| element.tag == OCTET_STRING)?;
    // [0] parameters: the curve's OID.
    let named = fields
        .next()
        .filter(|element| element.tag == 0xa0)
        .and_then(|element| {
            let oid = Reader {
                bytes: element.contents,
            }
            .next()?;
            (oid.tag == OBJECT_IDENTIFIER).then(|| curve_name(oid.contents))
        });
    let curve = named.unwrap_or(match private.contents.len() {
        32 => "P-256",
        48 => "P-384",
        66 => "P-521",
        _ => "an unknown curve",
    });
    Some(format!("ECDSA {curve} key"))
}

/// The algorithm of a PKCS#8 PrivateKeyInfo, and its size or curve.
fn pkcs8(der: &[u8]) -> Option<String> {
    let mut fields = sequence(der)?;
    let _version = fields.next()?;
    let algorithm = fields.next().filter(|element| element.tag == SEQUENCE)?;
    let private = fields
        .next()
        .filter(|element| element.tag == OCTET_STRING)?;
    let mut identifier = Reader {
        bytes: algorithm.contents,
    };
    let oid = identifier
        .next()
        .filter(|element| element.tag == OBJECT_IDENTIFIER)?;
    Some(match oid.contents {
        RSA_ENCRYPTION | RSASSA_PSS => rsa(rsa_bits(private.contents)?),
        EC_PUBLIC_KEY => {
            let curve = identifier
                .next()
                .filter(|element| element.tag == OBJECT_IDENTIFIER)
                .map_or("an unknown curve", |parameters| {
                    curve_name(parameters.contents)
                });
            format!("ECDSA {curve} key")
        }
        ED25519 => "Ed25519 key".to_owned(),
        ED448 => "Ed448 key".to_owned(),
        _ => return None,
    })
}

/// Whether ring signs with a key [`describe`] described so.
pub(crate) fn usable(described: &str) -> bool {
    let rsa_usable = RSA_BITS_SIGNED
        .iter()
        .any(|bits| described == rsa(*bits as usize));
    rsa_usable
        || matches!(
            described,
            "ECDSA P-256 key" | "ECDSA P-384 key" | "Ed25519 key"
        )
}

/// What the TLS library takes, for an error about a key it refused.
pub(crate) fn supported() -> String {
    let sizes: Vec<String> = RSA_BITS_SIGNED.iter().map(u32::to_string).collect();
    format!(
        "rustls with ring signs with RSA keys of {} bits (ring takes no other sizes), \
         ECDSA P-256 or P-384 keys and Ed25519 keys",
        sizes.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_and_integers_are_read_from_der() {
        // SEQUENCE { INTEGER 0, INTEGER 0x00 0x80 .. (9 bits? no: 0x0100 is 9 bits) }
        let key = [SEQUENCE, 7, INTEGER, 1, 0, INTEGER, 2, 0x01, 0x00];
        assert_eq!(rsa_bits(&key), Some(9));
        let key = [SEQUENCE, 8, INTEGER, 1, 0, INTEGER, 3, 0x00, 0x80, 0x00];
        assert_eq!(rsa_bits(&key), Some(16));
        assert_eq!(rsa_bits(&[SEQUENCE, 9, INTEGER]), None);
    }
}
