//! The handshake codec: what `RdmaHandshake` metadata carries between two RDMA data paths.
//!
//! The requester **offers** its NICs (link layer, LID, GID, NUMA node) and the queue pairs
//! it created on each (QPN, PSN); the holder **answers** with its NICs (the same, plus the
//! memory regions of its pool: address, length, rkey, registered once per NIC), and one
//! **link** per requester queue pair it connected: which of its NICs and queue pairs is the
//! other end. Requester queue pairs without a link were not paired (no compatible NIC) and
//! are destroyed.
//!
//! Wire format (little-endian), version 1:
//!
//! ```text
//! "PFRDMA" u8 version=1 u8 kind (1 offer, 2 answer) u64 conn_id
//! u16 fabric_len, fabric bytes (UTF-8; the emulator's socket path, empty on hardware)
//! u8 nics, each: u8 link (0 InfiniBand, 1 Ethernet) u8 port u16 lid [16] gid u8 gid_index
//!                i32 numa_node
//!                u16 mrs, each: u64 addr u64 len u32 rkey
//!                u16 qps, each: u32 qpn u32 psn
//! answer only: u16 links, each: u32 requester_qpn u8 holder_nic u32 holder_qpn
//! ```
//!
//! Decoding refuses (never panics on) truncated input, trailing bytes, another version, an
//! InfiniBand port with LID 0 (PegaFlow's #230: every WR would fail), an Ethernet port with
//! an all-zero GID, QPNs or PSNs beyond 24 bits, empty or overflowing regions, a link to a
//! queue pair the answer does not list, and counts beyond the limits below.

use crate::verbs::LinkLayer;

/// The magic every metadata starts with.
pub const MAGIC: &[u8; 6] = b"PFRDMA";
/// The codec's version.
pub const VERSION: u8 = 2;
/// NICs per side, at most.
pub const MAX_NICS: usize = 16;
/// Memory regions per NIC, at most.
pub const MAX_MRS: usize = 256;
/// Queue pairs per NIC, at most.
pub const MAX_QPS: usize = 256;
/// Fabric address bytes, at most.
pub const MAX_FABRIC: usize = 256;

/// A registered region as the holder advertises it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrInfo {
    /// First byte in the holder's address space.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Key to name it by in READs.
    pub rkey: u32,
}

/// A queue pair as advertised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
}

/// One NIC as advertised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicInfo {
    /// Link layer of its port.
    pub link: LinkLayer,
    /// Port number.
    pub port: u8,
    /// LID (InfiniBand).
    pub lid: u16,
    /// GID (RoCEv2).
    pub gid: [u8; 16],
    /// GID index.
    pub gid_index: u8,
    /// NUMA node; -1 = unknown.
    pub numa_node: i32,
    /// The port's active MTU (verbs numbering: 1 = 256 … 5 = 4096 bytes; 0 = unknown).
    pub mtu: u8,
    /// The pool's regions registered on it (answer), empty in an offer.
    pub mrs: Vec<MrInfo>,
    /// Its queue pairs in this connection.
    pub qps: Vec<QpInfo>,
}

/// A requester queue pair the holder connected: the holder's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkInfo {
    /// The requester's queue pair.
    pub requester_qpn: u32,
    /// The holder's NIC (index into the answer's NICs).
    pub holder_nic: u8,
    /// The holder's queue pair on that NIC.
    pub holder_qpn: u32,
}

/// Offer or answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Requester → holder.
    Offer,
    /// Holder → requester.
    Answer,
}

/// Decoded metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    /// Offer or answer.
    pub kind: Kind,
    /// The connection's id, chosen by the requester (the holder keys its end by it and the
    /// requester id, never by queue pair numbers, which two peers may share).
    pub conn_id: u64,
    /// The emulator's fabric address (the holder's socket path); empty on hardware.
    pub fabric: String,
    /// The sender's NICs.
    pub nics: Vec<NicInfo>,
    /// Answer only: the connected pairs.
    pub links: Vec<LinkInfo>,
}

/// Why metadata was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("RDMA handshake metadata refused: {0}")]
pub struct CodecError(pub String);

fn bad<T>(m: impl Into<String>) -> Result<T, CodecError> {
    Err(CodecError(m.into()))
}

impl Meta {
    /// The bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.nics.len() * 64);
        b.extend_from_slice(MAGIC);
        b.push(VERSION);
        b.push(match self.kind {
            Kind::Offer => 1,
            Kind::Answer => 2,
        });
        b.extend_from_slice(&self.conn_id.to_le_bytes());
        b.extend_from_slice(&(self.fabric.len() as u16).to_le_bytes());
        b.extend_from_slice(self.fabric.as_bytes());
        b.push(self.nics.len() as u8);
        for n in &self.nics {
            b.push(match n.link {
                LinkLayer::Infiniband => 0,
                LinkLayer::Ethernet => 1,
            });
            b.push(n.port);
            b.extend_from_slice(&n.lid.to_le_bytes());
            b.extend_from_slice(&n.gid);
            b.push(n.gid_index);
            b.extend_from_slice(&n.numa_node.to_le_bytes());
            b.push(n.mtu);
            b.extend_from_slice(&(n.mrs.len() as u16).to_le_bytes());
            for m in &n.mrs {
                b.extend_from_slice(&m.addr.to_le_bytes());
                b.extend_from_slice(&m.len.to_le_bytes());
                b.extend_from_slice(&m.rkey.to_le_bytes());
            }
            b.extend_from_slice(&(n.qps.len() as u16).to_le_bytes());
            for q in &n.qps {
                b.extend_from_slice(&q.qpn.to_le_bytes());
                b.extend_from_slice(&q.psn.to_le_bytes());
            }
        }
        if self.kind == Kind::Answer {
            b.extend_from_slice(&(self.links.len() as u16).to_le_bytes());
            for l in &self.links {
                b.extend_from_slice(&l.requester_qpn.to_le_bytes());
                b.push(l.holder_nic);
                b.extend_from_slice(&l.holder_qpn.to_le_bytes());
            }
        }
        b
    }

    /// Checks the limits an encoder must respect (what [`Meta::decode`] would refuse).
    ///
    /// # Errors
    /// The first limit broken.
    pub fn check(&self) -> Result<(), CodecError> {
        if self.fabric.len() > MAX_FABRIC {
            return bad(format!("fabric address of {} bytes", self.fabric.len()));
        }
        if self.nics.is_empty() || self.nics.len() > MAX_NICS {
            return bad(format!("{} NICs (1..={MAX_NICS})", self.nics.len()));
        }
        for (i, n) in self.nics.iter().enumerate() {
            match n.link {
                LinkLayer::Infiniband if n.lid == 0 => {
                    return bad(format!("NIC {i}: InfiniBand port with LID 0"))
                }
                LinkLayer::Ethernet if n.gid == [0; 16] => {
                    return bad(format!("NIC {i}: RoCE port with a zero GID"))
                }
                _ => {}
            }
            if n.mrs.len() > MAX_MRS || n.qps.len() > MAX_QPS {
                return bad(format!(
                    "NIC {i}: {} regions, {} queue pairs",
                    n.mrs.len(),
                    n.qps.len()
                ));
            }
            for m in &n.mrs {
                if m.len == 0 || m.addr.checked_add(m.len).is_none() {
                    return bad(format!("NIC {i}: region {:#x}+{}", m.addr, m.len));
                }
            }
            for q in &n.qps {
                if q.qpn >= 1 << 24 || q.psn >= 1 << 24 {
                    return bad(format!(
                        "NIC {i}: QPN {} / PSN {} beyond 24 bits",
                        q.qpn, q.psn
                    ));
                }
            }
        }
        if self.kind == Kind::Offer && !self.links.is_empty() {
            return bad("an offer with links");
        }
        if self.links.len() > MAX_NICS * MAX_QPS {
            return bad(format!("{} links", self.links.len()));
        }
        for l in &self.links {
            let ok = self
                .nics
                .get(l.holder_nic as usize)
                .is_some_and(|n| n.qps.iter().any(|q| q.qpn == l.holder_qpn));
            if !ok || l.requester_qpn >= 1 << 24 {
                return bad(format!(
                    "a link to NIC {} QPN {} the answer does not list",
                    l.holder_nic, l.holder_qpn
                ));
            }
        }
        Ok(())
    }

    /// Parses `b`.
    ///
    /// # Errors
    /// Anything malformed (module docs).
    pub fn decode(b: &[u8]) -> Result<Self, CodecError> {
        let mut r = Reader { b, at: 0 };
        if r.take(6)? != MAGIC {
            return bad("not RDMA handshake metadata (magic)");
        }
        let v = r.u8()?;
        if v != VERSION {
            return bad(format!("version {v}; this server speaks {VERSION}"));
        }
        let kind = match r.u8()? {
            1 => Kind::Offer,
            2 => Kind::Answer,
            k => return bad(format!("kind {k}")),
        };
        let conn_id = r.u64()?;
        let fl = r.u16()? as usize;
        if fl > MAX_FABRIC {
            return bad(format!("fabric address of {fl} bytes"));
        }
        let fabric = std::str::from_utf8(r.take(fl)?)
            .map_err(|_| CodecError("fabric address is not UTF-8".into()))?
            .to_owned();
        let n = r.u8()? as usize;
        if n == 0 || n > MAX_NICS {
            return bad(format!("{n} NICs (1..={MAX_NICS})"));
        }
        let mut nics = Vec::with_capacity(n);
        for _ in 0..n {
            let link = match r.u8()? {
                0 => LinkLayer::Infiniband,
                1 => LinkLayer::Ethernet,
                l => return bad(format!("link layer {l}")),
            };
            let port = r.u8()?;
            let lid = r.u16()?;
            let gid: [u8; 16] = r.take(16)?.try_into().expect("16 bytes");
            let gid_index = r.u8()?;
            let numa_node = r.u32()? as i32;
            let mtu = r.u8()?;
            if mtu > 5 {
                return bad(format!("MTU {mtu} (verbs numbers 0..=5)"));
            }
            let nm = r.u16()? as usize;
            if nm > MAX_MRS {
                return bad(format!("{nm} regions"));
            }
            let mut mrs = Vec::with_capacity(nm);
            for _ in 0..nm {
                mrs.push(MrInfo {
                    addr: r.u64()?,
                    len: r.u64()?,
                    rkey: r.u32()?,
                });
            }
            let nq = r.u16()? as usize;
            if nq > MAX_QPS {
                return bad(format!("{nq} queue pairs"));
            }
            let mut qps = Vec::with_capacity(nq);
            for _ in 0..nq {
                qps.push(QpInfo {
                    qpn: r.u32()?,
                    psn: r.u32()?,
                });
            }
            nics.push(NicInfo {
                link,
                port,
                lid,
                gid,
                gid_index,
                numa_node,
                mtu,
                mrs,
                qps,
            });
        }
        let mut links = Vec::new();
        if kind == Kind::Answer {
            let nl = r.u16()? as usize;
            if nl > MAX_NICS * MAX_QPS {
                return bad(format!("{nl} links"));
            }
            for _ in 0..nl {
                links.push(LinkInfo {
                    requester_qpn: r.u32()?,
                    holder_nic: r.u8()?,
                    holder_qpn: r.u32()?,
                });
            }
        }
        if r.at != b.len() {
            return bad(format!("{} trailing bytes", b.len() - r.at));
        }
        let m = Meta {
            kind,
            conn_id,
            fabric,
            nics,
            links,
        };
        m.check()?;
        Ok(m)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| CodecError(format!("truncated at byte {}", self.at)))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, CodecError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
}

/// Pairs the requester's NICs with the holder's, per requester queue pair: for a requester
/// NIC, the candidates are the holder's NICs of the same link layer on the same NUMA node
/// (ordinal: node 0 with node 0), else every holder NIC of that link layer; its queue pairs
/// go round-robin over the candidates, starting at an offset that spreads requester NICs.
/// Counts may differ on the two sides. Returns, per requester NIC, the holder NIC of each
/// of its `qps[i]` queue pairs (`None`: no compatible holder NIC).
pub fn pair(requester: &[NicInfo], holder: &[NicInfo]) -> Vec<Vec<Option<usize>>> {
    requester
        .iter()
        .enumerate()
        .map(|(ri, r)| {
            let same_link: Vec<usize> = (0..holder.len())
                .filter(|&h| holder[h].link == r.link)
                .collect();
            let near: Vec<usize> = same_link
                .iter()
                .copied()
                .filter(|&h| holder[h].numa_node == r.numa_node && r.numa_node >= 0)
                .collect();
            let cands = if near.is_empty() { same_link } else { near };
            (0..r.qps.len())
                .map(|q| {
                    if cands.is_empty() {
                        None
                    } else {
                        Some(cands[(ri + q) % cands.len()])
                    }
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(link: LinkLayer, numa: i32, qps: u32) -> NicInfo {
        NicInfo {
            link,
            port: 1,
            lid: if link == LinkLayer::Infiniband { 7 } else { 0 },
            gid: if link == LinkLayer::Ethernet {
                [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]
            } else {
                [0; 16]
            },
            gid_index: 3,
            numa_node: numa,
            mtu: 5,
            mrs: vec![MrInfo {
                addr: 0x7f00_0000_0000,
                len: 1 << 30,
                rkey: 0xdead_beef,
            }],
            qps: (0..qps)
                .map(|i| QpInfo {
                    qpn: 100 + i,
                    psn: 0xabcde,
                })
                .collect(),
        }
    }

    fn answer() -> Meta {
        Meta {
            kind: Kind::Answer,
            conn_id: 42,
            fabric: "/tmp/x.sock".into(),
            nics: vec![
                nic(LinkLayer::Infiniband, 0, 2),
                nic(LinkLayer::Ethernet, 1, 1),
            ],
            links: vec![
                LinkInfo {
                    requester_qpn: 5,
                    holder_nic: 0,
                    holder_qpn: 101,
                },
                LinkInfo {
                    requester_qpn: 6,
                    holder_nic: 1,
                    holder_qpn: 100,
                },
            ],
        }
    }

    #[test]
    fn round_trips() {
        let a = answer();
        assert_eq!(Meta::decode(&a.encode()).unwrap(), a);
        let mut o = answer();
        o.kind = Kind::Offer;
        o.links.clear();
        o.fabric.clear();
        assert_eq!(Meta::decode(&o.encode()).unwrap(), o);
    }

    #[test]
    fn malformed_input_is_refused_never_a_panic() {
        let good = answer().encode();
        // Every truncation.
        for n in 0..good.len() {
            assert!(Meta::decode(&good[..n]).is_err(), "truncated to {n}");
        }
        let mut t = good.clone();
        t.push(0);
        assert!(Meta::decode(&t).unwrap_err().0.contains("trailing"));
        let mut v = good.clone();
        v[6] = VERSION + 1;
        assert!(Meta::decode(&v).unwrap_err().0.contains("version"));
        v[6] = 1;
        assert!(
            Meta::decode(&v).unwrap_err().0.contains("version"),
            "version 1 (no MTU) is refused"
        );
        assert!(Meta::decode(b"pegaflow-tcp/1").is_err());
        // Every single-byte corruption decodes or is refused, never panics.
        for i in 0..good.len() {
            for x in [0u8, 0xff, 0x80] {
                let mut c = good.clone();
                c[i] = x;
                let _ = Meta::decode(&c);
            }
        }
    }

    #[test]
    fn addresses_that_cannot_work_are_refused() {
        let mut a = answer();
        a.nics[0].lid = 0;
        assert!(Meta::decode(&a.encode()).unwrap_err().0.contains("LID 0"));
        let mut a = answer();
        a.nics[1].gid = [0; 16];
        assert!(Meta::decode(&a.encode())
            .unwrap_err()
            .0
            .contains("zero GID"));
        let mut a = answer();
        a.nics[0].qps[0].qpn = 1 << 24;
        assert!(Meta::decode(&a.encode()).is_err());
        let mut a = answer();
        a.links[0].holder_qpn = 999;
        assert!(Meta::decode(&a.encode())
            .unwrap_err()
            .0
            .contains("does not list"));
        let mut a = answer();
        a.nics[0].mrs[0].len = 0;
        assert!(Meta::decode(&a.encode()).is_err());
        let mut a = answer();
        a.nics[0].mrs[0].addr = u64::MAX;
        assert!(Meta::decode(&a.encode()).is_err());
    }

    #[test]
    fn nics_pair_by_numa_then_spread_and_counts_may_differ() {
        use LinkLayer::*;
        // Two requester NICs (NUMA 0 and 1), one holder NIC: both pair with it.
        let p = pair(
            &[nic(Ethernet, 0, 2), nic(Ethernet, 1, 2)],
            &[nic(Ethernet, 0, 0)],
        );
        assert_eq!(p, vec![vec![Some(0), Some(0)], vec![Some(0), Some(0)]]);
        // Same NUMA node first.
        let h = [nic(Ethernet, 1, 0), nic(Ethernet, 0, 0)];
        let p = pair(&[nic(Ethernet, 0, 2), nic(Ethernet, 1, 2)], &h);
        assert_eq!(p, vec![vec![Some(1), Some(1)], vec![Some(0), Some(0)]]);
        // One requester NIC, two holder NICs on other nodes: its QPs spread over both.
        let p = pair(&[nic(Ethernet, -1, 4)], &h);
        assert_eq!(p, vec![vec![Some(0), Some(1), Some(0), Some(1)]]);
        // Link layers must match.
        let p = pair(&[nic(Infiniband, 0, 1)], &h);
        assert_eq!(p, vec![vec![None]]);
    }
}
