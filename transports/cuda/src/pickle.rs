//! A small, bounded pickle stack machine: just enough of Python's pickle format to read the
//! object graph of a pickled `CudaIPCWrapper` (engine-wire.md §8), and a small encoder that
//! writes such pickles the way CPython does (protocol 4), for tests and native tools.
//!
//! Owns: decoding a byte string into a [`Value`] tree, with every length checked against the
//! input, and the stack, memo, mark stack and container sizes bounded.
//!
//! Must never: execute or import anything (globals are recorded as names, `REDUCE`/`NEWOBJ`/
//! `BUILD` only record their arguments), panic on any input, allocate more than a small
//! multiple of the input size (memo values are shared through `Rc`, never deep-copied), or
//! accept an opcode outside the supported subset (the error names it and its offset).

use std::collections::HashMap;
use std::rc::Rc;

/// Largest pickle accepted, in bytes (a real wrapper is about 420 bytes).
pub const MAX_PICKLE_BYTES: usize = 64 << 10;
/// Most container-building opcodes (tuples, calls, dict and list updates) accepted. This bounds
/// the nesting depth of the result, so dropping or comparing it cannot overflow a thread's stack.
pub const MAX_BUILDS: usize = 1024;
/// Deepest value stack accepted.
pub const MAX_STACK: usize = 4096;
/// Most memo entries accepted.
pub const MAX_MEMO: usize = 4096;
/// Most nested MARKs accepted.
pub const MAX_MARKS: usize = 256;
/// Largest integer accepted by `LONG1`, in bytes (two's complement); wider ones are refused.
pub const MAX_LONG_BYTES: usize = 16;

/// A decoded pickle value. Containers share their children through `Rc`, so a memo reference
/// costs one pointer whatever the size of the value it names.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An integer that fits 128 bits.
    Int(i128),
    /// A `bytes` object.
    Bytes(Rc<[u8]>),
    /// A `str` object.
    Str(Rc<str>),
    /// A tuple.
    Tuple(Rc<[Value]>),
    /// A list.
    List(Rc<[Value]>),
    /// A dict, in insertion order (duplicate keys are kept; lookups take the last).
    Dict(Rc<[(Value, Value)]>),
    /// A global reference `module.name` (never resolved).
    Global {
        /// Module path.
        module: Rc<str>,
        /// Attribute name.
        name: Rc<str>,
    },
    /// `callable(*args)` recorded by `REDUCE`, or `cls.__new__(cls, *args)` by `NEWOBJ`.
    Call {
        /// What was called (usually a [`Value::Global`]).
        callable: Rc<Value>,
        /// The argument tuple.
        args: Rc<Value>,
        /// The state applied with `BUILD`, if any.
        state: Option<Rc<Value>>,
    },
}

impl Value {
    /// The dict entry for string key `key` (the last one when a key repeats).
    pub fn dict_get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .rev()
                .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// A short name of the value's type, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Bytes(_) => "bytes",
            Value::Str(_) => "str",
            Value::Tuple(_) => "tuple",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
            Value::Global { .. } => "global",
            Value::Call { .. } => "object",
        }
    }
}

/// Why a pickle could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickleError {
    /// The input ended inside an opcode or before `STOP`.
    #[error("pickle truncated at byte {0}")]
    Truncated(usize),
    /// An opcode outside the supported subset.
    #[error("unsupported pickle opcode 0x{op:02x} at byte {at}")]
    Unsupported {
        /// The opcode byte.
        op: u8,
        /// Its offset.
        at: usize,
    },
    /// Structurally invalid input (stack underflow, bad memo index, limit exceeded, ...).
    #[error("malformed pickle at byte {at}: {what}")]
    Malformed {
        /// Offset of the opcode.
        at: usize,
        /// What was wrong.
        what: String,
    },
}

fn malformed(at: usize, what: impl Into<String>) -> PickleError {
    PickleError::Malformed {
        at,
        what: what.into(),
    }
}

/// Pickle opcodes used by the decoder and the encoder.
mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const NONE: u8 = b'N';
    pub const REDUCE: u8 = b'R';
    pub const BINUNICODE: u8 = b'X';
    pub const EMPTY_LIST: u8 = b']';
    pub const APPEND: u8 = b'a';
    pub const BUILD: u8 = b'b';
    pub const GLOBAL: u8 = b'c';
    pub const APPENDS: u8 = b'e';
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const SETITEMS: u8 = b'u';
    pub const EMPTY_DICT: u8 = b'}';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const PROTO: u8 = 0x80;
    pub const NEWOBJ: u8 = 0x81;
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const STACK_GLOBAL: u8 = 0x93;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
}

enum Slot {
    Mark,
    Val(Value),
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(PickleError::Truncated(self.buf.len()))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, PickleError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, PickleError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, PickleError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    /// A length prefix that must fit in what is left of the input.
    fn len_u64(&mut self, n: u64, at: usize) -> Result<usize, PickleError> {
        let left = self.buf.len() - self.pos;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .ok_or_else(|| malformed(at, format!("length {n} exceeds the {left} bytes left")))
    }
    fn line(&mut self, at: usize) -> Result<&'a str, PickleError> {
        let rest = &self.buf[self.pos..];
        let nl = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(PickleError::Truncated(self.buf.len()))?;
        let s = std::str::from_utf8(&rest[..nl]).map_err(|_| malformed(at, "non-UTF-8 line"))?;
        self.pos += nl + 1;
        Ok(s)
    }
}

struct Machine {
    stack: Vec<Slot>,
    marks: usize,
    memo: HashMap<u32, Value>,
    builds: usize,
}

impl Machine {
    fn count_build(&mut self, at: usize) -> Result<(), PickleError> {
        self.builds += 1;
        if self.builds > MAX_BUILDS {
            return Err(malformed(at, format!("more than {MAX_BUILDS} containers")));
        }
        Ok(())
    }
    fn push(&mut self, v: Value, at: usize) -> Result<(), PickleError> {
        if self.stack.len() >= MAX_STACK {
            return Err(malformed(at, format!("stack deeper than {MAX_STACK}")));
        }
        self.stack.push(Slot::Val(v));
        Ok(())
    }
    fn pop(&mut self, at: usize) -> Result<Value, PickleError> {
        match self.stack.pop() {
            Some(Slot::Val(v)) => Ok(v),
            Some(Slot::Mark) => Err(malformed(at, "unexpected MARK on the stack")),
            None => Err(malformed(at, "stack underflow")),
        }
    }
    fn top(&self, at: usize) -> Result<&Value, PickleError> {
        match self.stack.last() {
            Some(Slot::Val(v)) => Ok(v),
            Some(Slot::Mark) => Err(malformed(at, "MARK on top of the stack")),
            None => Err(malformed(at, "stack underflow")),
        }
    }
    fn top_mut(&mut self, at: usize) -> Result<&mut Value, PickleError> {
        match self.stack.last_mut() {
            Some(Slot::Val(v)) => Ok(v),
            Some(Slot::Mark) => Err(malformed(at, "MARK on top of the stack")),
            None => Err(malformed(at, "stack underflow")),
        }
    }
    /// Pops everything down to the topmost MARK (removing it), in push order.
    fn pop_mark(&mut self, at: usize) -> Result<Vec<Value>, PickleError> {
        let pos = self
            .stack
            .iter()
            .rposition(|s| matches!(s, Slot::Mark))
            .ok_or_else(|| malformed(at, "no MARK on the stack"))?;
        let items = self.stack.split_off(pos + 1);
        self.stack.pop();
        self.marks -= 1;
        Ok(items
            .into_iter()
            .map(|s| match s {
                Slot::Val(v) => v,
                Slot::Mark => Value::None, // unreachable: pos is the topmost mark
            })
            .collect())
    }
    fn memo_put(&mut self, idx: u32, at: usize) -> Result<(), PickleError> {
        let v = self.top(at)?.clone();
        if self.memo.len() >= MAX_MEMO && !self.memo.contains_key(&idx) {
            return Err(malformed(at, format!("more than {MAX_MEMO} memo entries")));
        }
        self.memo.insert(idx, v);
        Ok(())
    }
    fn memo_get(&mut self, idx: u32, at: usize) -> Result<(), PickleError> {
        let v = self
            .memo
            .get(&idx)
            .cloned()
            .ok_or_else(|| malformed(at, format!("memo index {idx} not set")))?;
        self.push(v, at)
    }
}

fn utf8(b: &[u8], at: usize) -> Result<Rc<str>, PickleError> {
    std::str::from_utf8(b)
        .map(Rc::from)
        .map_err(|_| malformed(at, "string is not valid UTF-8"))
}

fn as_str(v: &Value, at: usize, what: &str) -> Result<Rc<str>, PickleError> {
    match v {
        Value::Str(s) => Ok(s.clone()),
        other => Err(malformed(
            at,
            format!("{what} must be a str, not {}", other.type_name()),
        )),
    }
}

/// Decodes a pickle (protocols 2–5, the opcode subset of engine-wire.md §8 plus a few
/// neighbours) into its top-level value.
///
/// Errors: [`PickleError`] on truncation, unsupported opcodes, malformed structure or a
/// breached limit ([`MAX_PICKLE_BYTES`], [`MAX_STACK`], [`MAX_MEMO`], [`MAX_MARKS`],
/// [`MAX_LONG_BYTES`]). Trailing bytes after `STOP` are refused.
pub fn decode(buf: &[u8]) -> Result<Value, PickleError> {
    if buf.len() > MAX_PICKLE_BYTES {
        return Err(malformed(
            0,
            format!(
                "{} bytes exceed the {MAX_PICKLE_BYTES}-byte limit",
                buf.len()
            ),
        ));
    }
    let mut r = Reader { buf, pos: 0 };
    let mut m = Machine {
        stack: Vec::new(),
        marks: 0,
        memo: HashMap::new(),
        builds: 0,
    };
    loop {
        let at = r.pos;
        let code = r.u8()?;
        match code {
            op::PROTO => {
                let v = r.u8()?;
                if !(2..=5).contains(&v) {
                    return Err(malformed(at, format!("unsupported pickle protocol {v}")));
                }
            }
            op::FRAME => {
                // The frame length is advisory for a whole-buffer reader; only check it fits.
                let n = r.u64()?;
                r.len_u64(n, at)?;
            }
            op::STOP => {
                let v = m.pop(at)?;
                if r.pos != buf.len() {
                    return Err(malformed(r.pos, "trailing bytes after STOP"));
                }
                return Ok(v);
            }
            op::MARK => {
                if m.marks >= MAX_MARKS {
                    return Err(malformed(at, format!("more than {MAX_MARKS} nested MARKs")));
                }
                if m.stack.len() >= MAX_STACK {
                    return Err(malformed(at, format!("stack deeper than {MAX_STACK}")));
                }
                m.marks += 1;
                m.stack.push(Slot::Mark);
            }
            op::POP => {
                match m.stack.pop() {
                    Some(Slot::Mark) => m.marks -= 1,
                    Some(Slot::Val(_)) => {}
                    None => return Err(malformed(at, "stack underflow")),
                };
            }
            op::NONE => m.push(Value::None, at)?,
            op::NEWTRUE => m.push(Value::Bool(true), at)?,
            op::NEWFALSE => m.push(Value::Bool(false), at)?,
            op::BININT1 => {
                let v = r.u8()?;
                m.push(Value::Int(v.into()), at)?;
            }
            op::BININT2 => {
                let v = r.u16()?;
                m.push(Value::Int(v.into()), at)?;
            }
            op::BININT => {
                let v = r.u32()? as i32;
                m.push(Value::Int(v.into()), at)?;
            }
            op::LONG1 => {
                let n = usize::from(r.u8()?);
                let b = r.take(n)?;
                if n > MAX_LONG_BYTES {
                    return Err(malformed(at, format!("integer of {n} bytes is too wide")));
                }
                let mut v: i128 = 0;
                for (i, &byte) in b.iter().enumerate() {
                    v |= i128::from(byte) << (8 * i);
                }
                if n > 0 && n < 16 && b[n - 1] & 0x80 != 0 {
                    v -= 1i128 << (8 * n); // sign-extend
                }
                m.push(Value::Int(v), at)?;
            }
            op::SHORT_BINUNICODE | op::BINUNICODE | op::BINUNICODE8 => {
                let n = match code {
                    op::SHORT_BINUNICODE => u64::from(r.u8()?),
                    op::BINUNICODE => u64::from(r.u32()?),
                    _ => r.u64()?,
                };
                let n = r.len_u64(n, at)?;
                let s = utf8(r.take(n)?, at)?;
                m.push(Value::Str(s), at)?;
            }
            op::SHORT_BINBYTES | op::BINBYTES | op::BINBYTES8 => {
                let n = match code {
                    op::SHORT_BINBYTES => u64::from(r.u8()?),
                    op::BINBYTES => u64::from(r.u32()?),
                    _ => r.u64()?,
                };
                let n = r.len_u64(n, at)?;
                let b = r.take(n)?;
                m.push(Value::Bytes(Rc::from(b)), at)?;
            }
            op::MEMOIZE => {
                let idx = u32::try_from(m.memo.len())
                    .map_err(|_| malformed(at, "memo index overflow"))?;
                m.memo_put(idx, at)?;
            }
            op::BINPUT => {
                let idx = r.u8()?.into();
                m.memo_put(idx, at)?;
            }
            op::LONG_BINPUT => {
                let idx = r.u32()?;
                m.memo_put(idx, at)?;
            }
            op::BINGET => {
                let idx = r.u8()?.into();
                m.memo_get(idx, at)?;
            }
            op::LONG_BINGET => {
                let idx = r.u32()?;
                m.memo_get(idx, at)?;
            }
            op::GLOBAL => {
                let module: Rc<str> = Rc::from(r.line(at)?);
                let name: Rc<str> = Rc::from(r.line(at)?);
                m.push(Value::Global { module, name }, at)?;
            }
            op::STACK_GLOBAL => {
                let name = m.pop(at)?;
                let module = m.pop(at)?;
                let g = Value::Global {
                    module: as_str(&module, at, "STACK_GLOBAL module")?,
                    name: as_str(&name, at, "STACK_GLOBAL name")?,
                };
                m.push(g, at)?;
            }
            op::EMPTY_TUPLE => m.push(Value::Tuple(Rc::from(Vec::new())), at)?,
            op::EMPTY_LIST => m.push(Value::List(Rc::from(Vec::new())), at)?,
            op::EMPTY_DICT => m.push(Value::Dict(Rc::from(Vec::new())), at)?,
            op::TUPLE => {
                m.count_build(at)?;
                let items = m.pop_mark(at)?;
                m.push(Value::Tuple(Rc::from(items)), at)?;
            }
            op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                m.count_build(at)?;
                let n = usize::from(code - op::TUPLE1 + 1);
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(m.pop(at)?);
                }
                items.reverse();
                m.push(Value::Tuple(Rc::from(items)), at)?;
            }
            op::APPEND | op::APPENDS => {
                m.count_build(at)?;
                let new = if code == op::APPEND {
                    vec![m.pop(at)?]
                } else {
                    m.pop_mark(at)?
                };
                let list = m.top_mut(at)?;
                match list {
                    Value::List(items) => {
                        let mut v = items.to_vec();
                        v.extend(new);
                        *items = Rc::from(v);
                    }
                    other => {
                        return Err(malformed(at, format!("APPEND to a {}", other.type_name())))
                    }
                }
            }
            op::SETITEM | op::SETITEMS => {
                m.count_build(at)?;
                let flat = if code == op::SETITEM {
                    let v = m.pop(at)?;
                    let k = m.pop(at)?;
                    vec![k, v]
                } else {
                    m.pop_mark(at)?
                };
                if flat.len() % 2 != 0 {
                    return Err(malformed(at, "SETITEMS with an odd number of items"));
                }
                let dict = m.top_mut(at)?;
                match dict {
                    Value::Dict(items) => {
                        let mut v = items.to_vec();
                        let mut it = flat.into_iter();
                        while let (Some(k), Some(val)) = (it.next(), it.next()) {
                            v.push((k, val));
                        }
                        *items = Rc::from(v);
                    }
                    other => {
                        return Err(malformed(at, format!("SETITEM on a {}", other.type_name())))
                    }
                }
            }
            op::REDUCE | op::NEWOBJ => {
                m.count_build(at)?;
                let args = m.pop(at)?;
                let callable = m.pop(at)?;
                if !matches!(args, Value::Tuple(_)) {
                    return Err(malformed(at, "call arguments must be a tuple"));
                }
                m.push(
                    Value::Call {
                        callable: Rc::new(callable),
                        args: Rc::new(args),
                        state: None,
                    },
                    at,
                )?;
            }
            op::BUILD => {
                m.count_build(at)?;
                let st = m.pop(at)?;
                match m.top_mut(at)? {
                    Value::Call { state, .. } if state.is_none() => *state = Some(Rc::new(st)),
                    other => {
                        return Err(malformed(at, format!("BUILD on a {}", other.type_name())))
                    }
                }
            }
            other => return Err(PickleError::Unsupported { op: other, at }),
        }
    }
}

/// Writes pickles the way CPython's protocol-4 pickler does for the values a `CudaIPCWrapper`
/// holds (every str, bytes and container memoized, framed), so tests can build what the
/// published client sends.
#[derive(Debug, Default)]
pub struct Encoder {
    body: Vec<u8>,
    memo: u32,
}

impl Encoder {
    /// A new, empty encoder.
    pub fn new() -> Self {
        Self::default()
    }
    fn memoize(&mut self) {
        self.body.push(op::MEMOIZE);
        self.memo += 1;
    }
    /// Pushes an integer (BININT1/BININT2/BININT, LONG1 beyond 32 bits).
    pub fn int(&mut self, v: i128) -> &mut Self {
        if (0..=0xff).contains(&v) {
            self.body.extend([op::BININT1, v as u8]);
        } else if (0..=0xffff).contains(&v) {
            self.body.push(op::BININT2);
            self.body.extend((v as u16).to_le_bytes());
        } else if i32::try_from(v).is_ok() {
            self.body.push(op::BININT);
            self.body.extend((v as i32).to_le_bytes());
        } else {
            // Minimal little-endian two's complement, as CPython's encode_long.
            let bytes = v.to_le_bytes();
            let mut n = 16;
            while n > 1 {
                let last = bytes[n - 1];
                let prev_sign = bytes[n - 2] & 0x80;
                if (last == 0 && prev_sign == 0) || (last == 0xff && prev_sign != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.body.extend([op::LONG1, n as u8]);
            self.body.extend(&bytes[..n]);
        }
        self
    }
    /// Pushes a bool.
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.body.push(if v { op::NEWTRUE } else { op::NEWFALSE });
        self
    }
    /// Pushes a str (SHORT_BINUNICODE or BINUNICODE) and memoizes it.
    pub fn str(&mut self, s: &str) -> &mut Self {
        if s.len() < 256 {
            self.body.extend([op::SHORT_BINUNICODE, s.len() as u8]);
        } else {
            self.body.push(op::BINUNICODE);
            self.body.extend((s.len() as u32).to_le_bytes());
        }
        self.body.extend(s.as_bytes());
        self.memoize();
        self
    }
    /// Pushes bytes (SHORT_BINBYTES or BINBYTES) and memoizes them.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        if b.len() < 256 {
            self.body.extend([op::SHORT_BINBYTES, b.len() as u8]);
        } else {
            self.body.push(op::BINBYTES);
            self.body.extend((b.len() as u32).to_le_bytes());
        }
        self.body.extend(b);
        self.memoize();
        self
    }
    /// Pushes the global `module.name` with STACK_GLOBAL and memoizes it.
    pub fn global(&mut self, module: &str, name: &str) -> &mut Self {
        self.str(module).str(name);
        self.body.push(op::STACK_GLOBAL);
        self.memoize();
        self
    }
    /// Starts a tuple or a SETITEMS run.
    pub fn mark(&mut self) -> &mut Self {
        self.body.push(op::MARK);
        self
    }
    /// Closes a tuple opened with [`Encoder::mark`] and memoizes it.
    pub fn tuple(&mut self) -> &mut Self {
        self.body.push(op::TUPLE);
        self.memoize();
        self
    }
    /// Wraps the top value in a 1-tuple and memoizes it.
    pub fn tuple1(&mut self) -> &mut Self {
        self.body.push(op::TUPLE1);
        self.memoize();
        self
    }
    /// Pushes `()`.
    pub fn empty_tuple(&mut self) -> &mut Self {
        self.body.push(op::EMPTY_TUPLE);
        self
    }
    /// Pushes `{}` and memoizes it.
    pub fn empty_dict(&mut self) -> &mut Self {
        self.body.push(op::EMPTY_DICT);
        self.memoize();
        self
    }
    /// Closes a SETITEMS run opened with [`Encoder::mark`].
    pub fn setitems(&mut self) -> &mut Self {
        self.body.push(op::SETITEMS);
        self
    }
    /// `callable(*args)`, memoized.
    pub fn reduce(&mut self) -> &mut Self {
        self.body.push(op::REDUCE);
        self.memoize();
        self
    }
    /// `cls.__new__(cls, *args)`, memoized.
    pub fn newobj(&mut self) -> &mut Self {
        self.body.push(op::NEWOBJ);
        self.memoize();
        self
    }
    /// Applies the state on top to the object below it.
    pub fn build(&mut self) -> &mut Self {
        self.body.push(op::BUILD);
        self
    }
    /// Finishes with STOP and returns the whole pickle (PROTO 4, one FRAME).
    pub fn finish(&mut self) -> Vec<u8> {
        self.body.push(op::STOP);
        let mut out = Vec::with_capacity(self.body.len() + 11);
        out.extend([op::PROTO, 4]);
        // CPython frames the body when it reaches 4 bytes or more (always, here).
        out.push(op::FRAME);
        out.extend((self.body.len() as u64).to_le_bytes());
        out.extend(&self.body);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_roundtrip_through_long1() {
        for v in [
            0i128,
            1,
            255,
            256,
            65535,
            65536,
            -1,
            -129,
            i32::MAX as i128,
            i32::MAX as i128 + 1,
            1 << 40,
            -(1 << 40),
            u64::MAX as i128,
            i64::MIN as i128,
        ] {
            let mut e = Encoder::new();
            e.int(v);
            let p = e.finish();
            assert_eq!(decode(&p).unwrap(), Value::Int(v), "{v}");
        }
    }

    #[test]
    fn memo_shares_instead_of_copying() {
        // memo[i+1] = (memo[i], memo[i]): 2^200 nodes if copied, 200 if shared.
        let mut p = vec![op::PROTO, 4, op::EMPTY_TUPLE, op::MEMOIZE];
        for i in 0..200u32 {
            p.push(op::LONG_BINGET);
            p.extend(i.to_le_bytes());
            p.push(op::LONG_BINGET);
            p.extend(i.to_le_bytes());
            p.extend([op::TUPLE2, op::MEMOIZE, op::POP]);
        }
        p.push(op::LONG_BINGET);
        p.extend(200u32.to_le_bytes());
        p.push(op::STOP);
        assert!(matches!(decode(&p), Ok(Value::Tuple(t)) if t.len() == 2));
    }

    #[test]
    fn nesting_is_bounded() {
        let mut p = vec![op::PROTO, 4, op::EMPTY_TUPLE];
        p.extend(std::iter::repeat_n(op::TUPLE1, 50_000));
        p.push(op::STOP);
        assert!(matches!(decode(&p), Err(PickleError::Malformed { .. })));
    }

    #[test]
    fn refuses_trailing_bytes_and_unknown_opcodes() {
        assert!(matches!(
            decode(&[op::PROTO, 4, op::NONE, op::STOP, 0]),
            Err(PickleError::Malformed { .. })
        ));
        assert_eq!(
            decode(&[op::PROTO, 4, b'i']),
            Err(PickleError::Unsupported { op: b'i', at: 2 })
        );
        assert!(matches!(
            decode(&[op::PROTO, 4]),
            Err(PickleError::Truncated(_))
        ));
    }

    #[test]
    fn stack_depth_is_bounded() {
        let mut p = vec![op::PROTO, 4];
        p.extend(std::iter::repeat_n(op::NONE, MAX_STACK + 1));
        p.push(op::STOP);
        assert!(matches!(decode(&p), Err(PickleError::Malformed { .. })));
    }
}
