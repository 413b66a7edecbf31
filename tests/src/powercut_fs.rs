//! A file system that forgets what was not synced when the power is cut.
//!
//! [`PowerCutFs`] mounts an in-memory FUSE file system on a temporary
//! directory. It models a disk with a volatile write cache, the strict POSIX
//! way:
//!
//! - every regular file has `current` bytes (what reads see) and `durable`
//!   bytes (what survives a cut). `fsync`/`fdatasync` on the file makes its
//!   durable bytes and size equal to its current ones. Nothing else does:
//!   not `close`, not `sync_file_range`, not time passing;
//! - every directory has `current` entries and `durable` entries. Only
//!   `fsync` on the directory itself (`FUSE_FSYNCDIR`) makes its entries
//!   durable, so a creation, unlink or rename survives a cut only once the
//!   directory holding the name was synced. A file that was synced but whose
//!   name never became durable is gone after a cut;
//! - [`PowerCutFs::power_cut`] turns every file's and directory's current
//!   state into its durable one and drops every inode no durable name
//!   reaches any more.
//!
//! Only contents and names are modelled durably; modes and times are kept
//! as they are (nobody in the tests relies on them). Inodes are never freed
//! before a cut (an unlinked file may still be named by a durable entry),
//! and inode numbers are never reused, so the kernel never confuses a file
//! that a cut removed with a new one.
//!
//! The kernel keeps nothing the file system does not see: files are opened
//! with `FOPEN_DIRECT_IO` (no page cache: every `read` and `write` reaches
//! the file system), there is no writeback cache, and attributes and names
//! are given with a time-to-live of zero, so after a cut the kernel asks
//! again.
//!
//! A cut must only be made while no process uses the file system (kill it
//! and wait for it first). [`PowerCutFs::freeze`] makes every operation fail
//! with `EIO` until [`PowerCutFs::thaw`], so nothing still in flight can
//! land between the kill and the cut.
//!
//! It is mounted with `mount(2)` directly (fuser's pure-Rust path, no
//! `fusermount`, no libfuse), which needs `/dev/fuse` and root (or
//! `CAP_SYS_ADMIN`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use fuser::{
    AccessFlags, BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem,
    FopenFlags, Generation, INodeNo, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, TimeOrNow, WriteFlags,
};

/// Attributes and names are never cached by the kernel.
const TTL: Duration = Duration::ZERO;
/// Dirty tracking granularity: a page that was written since the last
/// `fsync` may differ from its durable copy.
const PAGE: u64 = 4096;
/// The file type bits of a mode, and a regular file's (`S_IFMT`, `S_IFREG`).
const S_IFMT: u32 = 0o170000;
const S_IFREG: u32 = 0o100000;
/// The file system's size, as `statfs` tells it.
const CAPACITY_BLOCKS: u64 = 1 << 24;

/// What the file system saw, for assertions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// `fsync`/`fdatasync` calls on files.
    pub fsyncs: u64,
    /// `fsync` calls on directories.
    pub fsyncdirs: u64,
    /// `write` calls.
    pub writes: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Operations refused with `EIO` because the file system was frozen.
    pub refused_frozen: u64,
    /// Power cuts so far.
    pub cuts: u64,
}

/// What one power cut discarded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CutReport {
    /// Bytes of files that still exist after the cut whose content changed
    /// back (written and not synced, or a size change not synced), plus
    /// every byte of the files the cut removed.
    pub bytes_forgotten: u64,
    /// Files and directories that had a name before the cut but no
    /// durable one: gone.
    pub inodes_dropped: u64,
    /// Directory entries that changed back (created, removed or renamed
    /// and not synced).
    pub entries_reverted: u64,
    /// The paths that changed back, for diagnostics (at most a few dozen).
    pub changed: Vec<String>,
}

/// A regular file's two states.
#[derive(Debug, Default)]
struct FileBody {
    current: Vec<u8>,
    durable: Vec<u8>,
    /// Pages of `current` written since the last fsync; every byte below
    /// `min(current.len(), durable.len())` outside them is equal in both.
    dirty: BTreeSet<u64>,
}

impl FileBody {
    fn mark_dirty(&mut self, from: u64, to: u64) {
        if to > from {
            self.dirty.extend(from / PAGE..=(to - 1) / PAGE);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset + data.len() as u64;
        // A write past the end fills the gap with zeros: dirty too.
        let from = offset.min(self.current.len() as u64);
        if end as usize > self.current.len() {
            self.current.resize(end as usize, 0);
        }
        self.current[offset as usize..end as usize].copy_from_slice(data);
        self.mark_dirty(from, end);
    }

    fn set_len(&mut self, len: u64) {
        let old = self.current.len() as u64;
        self.current.resize(len as usize, 0);
        self.mark_dirty(old.min(len), old.max(len));
    }

    fn sync(&mut self) {
        let len = self.current.len();
        self.durable.resize(len, 0);
        for page in std::mem::take(&mut self.dirty) {
            let from = (page * PAGE) as usize;
            if from >= len {
                continue;
            }
            let to = (from + PAGE as usize).min(len);
            self.durable[from..to].copy_from_slice(&self.current[from..to]);
        }
    }

    /// Turns current into durable; returns how many bytes changed.
    fn cut(&mut self) -> u64 {
        let common = self.current.len().min(self.durable.len());
        let mut changed = self.current.len().abs_diff(self.durable.len()) as u64;
        for page in std::mem::take(&mut self.dirty) {
            let from = (page * PAGE) as usize;
            if from >= common {
                continue;
            }
            let to = (from + PAGE as usize).min(common);
            changed += self.current[from..to]
                .iter()
                .zip(&self.durable[from..to])
                .filter(|(a, b)| a != b)
                .count() as u64;
        }
        self.current = self.durable.clone();
        changed
    }
}

/// A directory's two states: name → inode.
#[derive(Debug, Default)]
struct DirBody {
    current: BTreeMap<OsString, u64>,
    durable: BTreeMap<OsString, u64>,
}

#[derive(Debug)]
enum Body {
    File(FileBody),
    Dir(DirBody),
}

#[derive(Debug)]
struct Node {
    body: Body,
    perm: u16,
    uid: u32,
    gid: u32,
    mtime: SystemTime,
}

impl Node {
    fn attr(&self, ino: u64) -> FileAttr {
        let (kind, size, nlink) = match &self.body {
            Body::File(f) => (FileType::RegularFile, f.current.len() as u64, 1),
            Body::Dir(_) => (FileType::Directory, 0, 2),
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: self.mtime,
            mtime: self.mtime,
            ctime: self.mtime,
            crtime: self.mtime,
            kind,
            perm: self.perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: PAGE as u32,
            flags: 0,
        }
    }
}

/// The whole disk, behind one lock: every operation is atomic with respect
/// to a cut.
#[derive(Debug)]
struct Disk {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    frozen: bool,
    stats: Stats,
}

impl Disk {
    fn new() -> Self {
        let root = Node {
            body: Body::Dir(DirBody::default()),
            perm: 0o755,
            uid: 0,
            gid: 0,
            mtime: SystemTime::now(),
        };
        Disk {
            nodes: HashMap::from([(INodeNo::ROOT.0, root)]),
            next_ino: INodeNo::ROOT.0 + 1,
            frozen: false,
            stats: Stats::default(),
        }
    }

    fn node(&mut self, ino: INodeNo) -> Result<&mut Node, Errno> {
        self.nodes.get_mut(&ino.0).ok_or(Errno::ENOENT)
    }

    fn file(&mut self, ino: INodeNo) -> Result<&mut FileBody, Errno> {
        match &mut self.node(ino)?.body {
            Body::File(f) => Ok(f),
            Body::Dir(_) => Err(Errno::EISDIR),
        }
    }

    fn dir(&mut self, ino: INodeNo) -> Result<&mut DirBody, Errno> {
        match &mut self.node(ino)?.body {
            Body::Dir(d) => Ok(d),
            Body::File(_) => Err(Errno::ENOTDIR),
        }
    }

    fn lookup(&mut self, parent: INodeNo, name: &OsStr) -> Result<FileAttr, Errno> {
        let ino = *self.dir(parent)?.current.get(name).ok_or(Errno::ENOENT)?;
        Ok(self.node(INodeNo(ino))?.attr(ino))
    }

    /// Adds a new node named `name` in `parent` (current entries only).
    fn add(
        &mut self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        body: Body,
        mode: u32,
        umask: u32,
    ) -> Result<FileAttr, Errno> {
        if self.dir(parent)?.current.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        let node = Node {
            body,
            perm: (mode & !umask & 0o7777) as u16,
            uid: req.uid(),
            gid: req.gid(),
            mtime: SystemTime::now(),
        };
        let attr = node.attr(ino);
        self.nodes.insert(ino, node);
        self.dir(parent)?.current.insert(name.to_owned(), ino);
        Ok(attr)
    }

    fn remove(&mut self, parent: INodeNo, name: &OsStr, dir: bool) -> Result<(), Errno> {
        let ino = *self.dir(parent)?.current.get(name).ok_or(Errno::ENOENT)?;
        match (&self.node(INodeNo(ino))?.body, dir) {
            (Body::File(_), true) => return Err(Errno::ENOTDIR),
            (Body::Dir(_), false) => return Err(Errno::EISDIR),
            (Body::Dir(d), true) if !d.current.is_empty() => return Err(Errno::ENOTEMPTY),
            _ => {}
        }
        // The inode stays until a cut: a durable entry may still name it.
        self.dir(parent)?.current.remove(name);
        Ok(())
    }

    fn rename(
        &mut self,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
    ) -> Result<(), Errno> {
        if flags.contains(RenameFlags::RENAME_EXCHANGE)
            || flags.contains(RenameFlags::RENAME_WHITEOUT)
        {
            return Err(Errno::EINVAL);
        }
        let ino = *self.dir(parent)?.current.get(name).ok_or(Errno::ENOENT)?;
        let moving_dir = matches!(self.node(INodeNo(ino))?.body, Body::Dir(_));
        if let Some(&target) = self.dir(newparent)?.current.get(newname) {
            if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                return Err(Errno::EEXIST);
            }
            if target == ino {
                return Ok(());
            }
            match (&self.node(INodeNo(target))?.body, moving_dir) {
                (Body::Dir(_), false) => return Err(Errno::EISDIR),
                (Body::File(_), true) => return Err(Errno::ENOTDIR),
                (Body::Dir(d), true) if !d.current.is_empty() => return Err(Errno::ENOTEMPTY),
                _ => {}
            }
        }
        self.dir(parent)?.current.remove(name);
        self.dir(newparent)?.current.insert(newname.to_owned(), ino);
        Ok(())
    }

    /// Every inode a name reaches from the root, with its path, following
    /// the durable names or the current ones.
    fn reachable(&self, durable: bool) -> HashMap<u64, String> {
        let mut reachable = HashMap::new();
        let mut stack = vec![(INodeNo::ROOT.0, String::new())];
        while let Some((ino, path)) = stack.pop() {
            if reachable.contains_key(&ino) {
                continue;
            }
            if let Some(Node {
                body: Body::Dir(d), ..
            }) = self.nodes.get(&ino)
            {
                let names = if durable { &d.durable } else { &d.current };
                for (name, &child) in names {
                    stack.push((child, format!("{path}/{}", name.to_string_lossy())));
                }
            }
            reachable.insert(ino, path);
        }
        reachable
    }

    /// Pages written and directories changed since they were last synced.
    fn unsynced(&self) -> u64 {
        self.nodes
            .values()
            .map(|node| match &node.body {
                Body::File(f) => f.dirty.len() as u64,
                Body::Dir(d) => u64::from(d.current != d.durable),
            })
            .sum()
    }

    fn power_cut(&mut self) -> CutReport {
        let mut report = CutReport::default();
        let reachable = self.reachable(true);
        let named = self.reachable(false);
        let mut changed = Vec::new();
        self.nodes.retain(|ino, node| {
            if reachable.contains_key(ino) {
                return true;
            }
            // A file still named before the cut is lost; one that was
            // removed (and the removal synced) is only collected.
            if named.contains_key(ino) {
                report.inodes_dropped += 1;
                if let Body::File(f) = &node.body {
                    report.bytes_forgotten += f.current.len() as u64;
                }
            }
            false
        });
        for (ino, node) in &mut self.nodes {
            let path = &reachable[ino];
            match &mut node.body {
                Body::File(f) => {
                    let bytes = f.cut();
                    if bytes > 0 {
                        changed.push(format!("{path}: {bytes} bytes"));
                    }
                    report.bytes_forgotten += bytes;
                }
                Body::Dir(d) => {
                    let names: BTreeSet<&OsString> =
                        d.current.keys().chain(d.durable.keys()).collect();
                    let mut reverted = 0;
                    for name in names {
                        if d.current.get(name) != d.durable.get(name) {
                            reverted += 1;
                            changed.push(format!(
                                "{path}/{}: {}",
                                name.to_string_lossy(),
                                match (d.current.contains_key(name), d.durable.contains_key(name)) {
                                    (true, false) => "name not synced, gone",
                                    (false, true) => "removal not synced, back",
                                    _ => "rename not synced, undone",
                                }
                            ));
                        }
                    }
                    report.entries_reverted += reverted;
                    d.current = d.durable.clone();
                }
            }
        }
        changed.sort();
        changed.truncate(40);
        report.changed = changed;
        self.stats.cuts += 1;
        report
    }
}

/// The FUSE side: every request takes the disk's lock.
#[derive(Debug)]
struct Fs {
    disk: Arc<Mutex<Disk>>,
}

impl Fs {
    /// The disk, or `EIO` while frozen.
    fn disk(&self) -> Result<MutexGuard<'_, Disk>, Errno> {
        let mut disk = self.disk.lock().unwrap_or_else(|e| e.into_inner());
        if disk.frozen {
            disk.stats.refused_frozen += 1;
            return Err(Errno::EIO);
        }
        Ok(disk)
    }

    fn with<T>(&self, op: impl FnOnce(&mut Disk) -> Result<T, Errno>) -> Result<T, Errno> {
        op(&mut *self.disk()?)
    }
}

/// Replies `Ok(())` or the error.
fn empty(reply: ReplyEmpty, result: Result<(), Errno>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

fn entry(reply: ReplyEntry, result: Result<FileAttr, Errno>) {
    match result {
        Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
        Err(e) => reply.error(e),
    }
}

fn attr(reply: ReplyAttr, result: Result<FileAttr, Errno>) {
    match result {
        Ok(attr) => reply.attr(&TTL, &attr),
        Err(e) => reply.error(e),
    }
}

impl Filesystem for Fs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        entry(reply, self.with(|d| d.lookup(parent, name)));
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        attr(reply, self.with(|d| Ok(d.node(ino)?.attr(ino.0))));
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        attr(
            reply,
            self.with(|d| {
                if let Some(size) = size {
                    d.file(ino)?.set_len(size);
                }
                let node = d.node(ino)?;
                if let Some(mode) = mode {
                    node.perm = (mode & 0o7777) as u16;
                }
                if size.is_some() {
                    node.mtime = SystemTime::now();
                }
                // Owners and times are accepted and ignored.
                Ok(node.attr(ino.0))
            }),
        );
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        // Regular files only.
        if mode & S_IFMT != S_IFREG {
            return reply.error(Errno::EPERM);
        }
        let body = || Body::File(FileBody::default());
        entry(
            reply,
            self.with(|d| d.add(req, parent, name, body(), mode, umask)),
        );
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let body = || Body::Dir(DirBody::default());
        entry(
            reply,
            self.with(|d| d.add(req, parent, name, body(), mode, umask)),
        );
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.with(|d| d.remove(parent, name, false)));
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.with(|d| d.remove(parent, name, true)));
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        empty(
            reply,
            self.with(|d| d.rename(parent, name, newparent, newname, flags)),
        );
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // Direct I/O: the kernel keeps no page cache of it.
        match self.with(|d| d.file(ino).map(drop)) {
            Ok(()) => reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let result = self.with(|d| {
            let f = d.file(ino)?;
            let len = f.current.len() as u64;
            let from = offset.min(len) as usize;
            let to = (offset + u64::from(size)).min(len) as usize;
            Ok(f.current[from..to].to_vec())
        });
        match result {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let result = self.with(|d| {
            d.file(ino)?.write(offset, data);
            d.node(ino)?.mtime = SystemTime::now();
            d.stats.writes += 1;
            d.stats.bytes_written += data.len() as u64;
            Ok(())
        });
        match result {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) makes nothing durable.
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        empty(
            reply,
            self.with(|d| {
                d.file(ino)?.sync();
                d.stats.fsyncs += 1;
                Ok(())
            }),
        );
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.with(|d| d.dir(ino).map(drop)) {
            Ok(()) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let listing = self.with(|d| {
            let names: Vec<(OsString, u64)> = d
                .dir(ino)?
                .current
                .iter()
                .map(|(n, &i)| (n.clone(), i))
                .collect();
            let mut all = vec![
                (OsString::from("."), ino.0, FileType::Directory),
                // The parent's number does not matter to anybody here.
                (OsString::from(".."), INodeNo::ROOT.0, FileType::Directory),
            ];
            for (name, child) in names {
                let kind = match d.node(INodeNo(child))?.body {
                    Body::File(_) => FileType::RegularFile,
                    Body::Dir(_) => FileType::Directory,
                };
                all.push((name, child, kind));
            }
            Ok(all)
        });
        match listing {
            Ok(all) => {
                // An entry's offset is the index of the next one.
                for (i, (name, child, kind)) in all.into_iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(child), i as u64 + 1, kind, &name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        empty(
            reply,
            self.with(|d| {
                let dir = d.dir(ino)?;
                dir.durable = dir.current.clone();
                d.stats.fsyncdirs += 1;
                Ok(())
            }),
        );
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.disk() {
            Ok(_) => reply.statfs(
                CAPACITY_BLOCKS,
                CAPACITY_BLOCKS / 2,
                CAPACITY_BLOCKS / 2,
                1 << 20,
                1 << 19,
                PAGE as u32,
                255,
                PAGE as u32,
            ),
            Err(e) => reply.error(e),
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        empty(reply, self.with(|d| d.node(ino).map(drop)));
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let body = || Body::File(FileBody::default());
        match self.with(|d| d.add(req, parent, name, body(), mode, umask)) {
            Ok(attr) => reply.created(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(0),
                FopenFlags::FOPEN_DIRECT_IO,
            ),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        // Plain allocation only: it may grow the file, with zeros.
        if mode != 0 {
            return reply.error(Errno::EOPNOTSUPP);
        }
        empty(
            reply,
            self.with(|d| {
                let f = d.file(ino)?;
                if offset + length > f.current.len() as u64 {
                    f.set_len(offset + length);
                }
                Ok(())
            }),
        );
    }
}

/// The file system, mounted on a temporary directory; unmounted on drop.
#[derive(Debug)]
pub struct PowerCutFs {
    disk: Arc<Mutex<Disk>>,
    session: Option<BackgroundSession>,
    mountpoint: PathBuf,
    // Removed (empty) after the unmount.
    _dir: tempfile::TempDir,
}

impl PowerCutFs {
    /// Mounts a new, empty file system. Fails, saying why, if `/dev/fuse`
    /// is missing or the mount is refused.
    pub fn mount() -> anyhow::Result<PowerCutFs> {
        if !Path::new("/dev/fuse").exists() {
            bail!(
                "/dev/fuse is missing: the power-cut file system needs the FUSE device \
                 (modprobe fuse; in a container, --device /dev/fuse and CAP_SYS_ADMIN)"
            );
        }
        let dir = tempfile::Builder::new()
            .prefix("edgefleet-powercut-")
            .tempdir()
            .context("create the mount point")?;
        let mountpoint = dir.path().to_owned();
        let disk = Arc::new(Mutex::new(Disk::new()));
        let mut config = Config::default();
        // No AutoUnmount: that option needs the fusermount binary, without
        // it fuser calls mount(2) itself.
        config.mount_options = vec![
            MountOption::FSName("edgefleet-powercut".into()),
            MountOption::RW,
            MountOption::NoAtime,
        ];
        let fs = Fs {
            disk: Arc::clone(&disk),
        };
        let session = fuser::spawn_mount(fs, &mountpoint, &config).with_context(|| {
            format!(
                "mount the power-cut FUSE file system on {} (mount(2) of type fuse needs \
                 root or CAP_SYS_ADMIN and /dev/fuse)",
                mountpoint.display()
            )
        })?;
        let fs = PowerCutFs {
            disk,
            session: Some(session),
            mountpoint,
            _dir: dir,
        };
        // The mount is in place once the root answers through the kernel
        // (a listing leaves nothing behind, unlike a probe file).
        std::fs::read_dir(&fs.mountpoint).with_context(|| {
            format!(
                "the FUSE mount on {} does not work",
                fs.mountpoint.display()
            )
        })?;
        Ok(fs)
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    fn lock(&self) -> MutexGuard<'_, Disk> {
        self.disk.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every operation fails with `EIO` from now until [`PowerCutFs::thaw`].
    pub fn freeze(&self) {
        self.lock().frozen = true;
    }

    /// Freezes the file system only if a cut now would undo something
    /// (see [`PowerCutFs::unsynced`]), checked and frozen at once; returns
    /// whether it did.
    pub fn freeze_if_unsynced(&self) -> bool {
        let mut disk = self.lock();
        if disk.unsynced() > 0 {
            disk.frozen = true;
        }
        disk.frozen
    }

    /// Operations work again.
    pub fn thaw(&self) {
        self.lock().frozen = false;
    }

    /// Cuts the power: every file and directory goes back to what was
    /// synced, and what no durable name reaches is gone. Freezes the file
    /// system if it was not (it stays frozen until [`PowerCutFs::thaw`]).
    /// Only call it once every process using the file system has exited.
    pub fn power_cut(&self) -> CutReport {
        let mut disk = self.lock();
        disk.frozen = true;
        disk.power_cut()
    }

    /// How much a cut now would undo: pages written and not synced, plus
    /// directories whose entries changed and were not synced.
    pub fn unsynced(&self) -> u64 {
        self.lock().unsynced()
    }

    /// What the file system saw so far.
    pub fn stats(&self) -> Stats {
        self.lock().stats
    }
}

impl Drop for PowerCutFs {
    fn drop(&mut self) {
        self.thaw();
        if let Some(session) = self.session.take()
            && let Err(error) = session.umount_and_join()
        {
            eprintln!(
                "could not unmount the power-cut file system on {}: {error}",
                self.mountpoint.display()
            );
        }
    }
}
