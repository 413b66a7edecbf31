// Command edgefleet-controlplane runs a real, local Kubernetes control plane
// for tests: the upstream kube-apiserver in-process, backed by an embedded
// etcd, both listening on 127.0.0.1 only (in the spirit of controller-runtime's
// envtest).
//
// Usage:
//
//	edgefleet-controlplane --data-dir DIR [--kubeconfig PATH] [--port N] [-- KUBE-APISERVER-FLAGS...]
//
// Once /readyz answers ok it prints exactly one line on stdout,
//
//	READY <absolute kubeconfig path>
//
// and keeps serving until SIGTERM/SIGINT or until its stdin reaches EOF, so a
// test process that dies (even by SIGKILL) takes the control plane with it.
package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

const (
	serviceCIDR      = "10.0.0.0/24"
	readyTimeout     = 2 * time.Minute
	shutdownDeadline = 5 * time.Second
)

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "edgefleet-controlplane: "+format+"\n", args...)
}

func main() {
	os.Exit(run())
}

func run() int {
	start := time.Now()

	var (
		dataDir        string
		kubeconfigPath string
		verbose        bool
		watchStdin     bool
		port           int
	)
	flag.StringVar(&dataDir, "data-dir", "", "directory for etcd data, certificates, logs and the kubeconfig (required)")
	flag.StringVar(&kubeconfigPath, "kubeconfig", "", "where to write the admin kubeconfig (default DATA-DIR/kubeconfig)")
	flag.BoolVar(&verbose, "verbose", false, "send kube-apiserver and etcd logs to stderr instead of DATA-DIR/logs/")
	flag.BoolVar(&watchStdin, "watch-stdin", true, "shut down when stdin reaches EOF")
	flag.IntVar(&port, "port", 0, "the API server's port on 127.0.0.1 (default: a free one); give the same port to a restart on the same data dir to keep the kubeconfig valid")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: edgefleet-controlplane --data-dir DIR [--kubeconfig PATH] [--port N] [--verbose] [--watch-stdin=false] [-- KUBE-APISERVER-FLAGS...]\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	extraAPIServerArgs := flag.Args()
	if dataDir == "" {
		flag.Usage()
		return 2
	}

	// The READY line is the only thing that may reach stdout: keep a private
	// handle on it and point fd 1 at stderr for everybody else.
	readyOut := redirectStdoutToStderr()

	var err error
	if dataDir, err = filepath.Abs(dataDir); err != nil {
		logf("%v", err)
		return 1
	}
	if kubeconfigPath == "" {
		kubeconfigPath = filepath.Join(dataDir, "kubeconfig")
	}
	if kubeconfigPath, err = filepath.Abs(kubeconfigPath); err != nil {
		logf("%v", err)
		return 1
	}
	logDir := filepath.Join(dataDir, "logs")
	for _, d := range []string{dataDir, logDir, filepath.Dir(kubeconfigPath)} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			logf("%v", err)
			return 1
		}
	}

	// Logging: kube-apiserver (klog) and etcd (zap) are chatty; by default
	// they write to files in DATA-DIR/logs.
	apiLogPath := filepath.Join(logDir, "kube-apiserver.log")
	etcdLog, etcdLogLevel := filepath.Join(logDir, "etcd.log"), "warn"
	var apiLog io.Writer = os.Stderr
	if verbose {
		etcdLog, etcdLogLevel = "stderr", "info"
	} else {
		f, err := os.OpenFile(apiLogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			logf("%v", err)
			return 1
		}
		defer f.Close()
		apiLog = f
		klog.LogToStderr(false)
		klog.SetOutput(f)
	}
	defer klog.Flush()

	// Shutdown triggers: SIGTERM/SIGINT, or EOF on stdin.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stopOnce sync.Once
	stop := func(why string) {
		stopOnce.Do(func() {
			logf("shutting down (%s)", why)
			cancel()
			// Nothing may keep us alive for long once asked to go.
			time.AfterFunc(shutdownDeadline, func() {
				logf("graceful shutdown took longer than %s, exiting anyway", shutdownDeadline)
				klog.Flush()
				os.Exit(0)
			})
		})
	}
	// If our parent dies, stderr may be a broken pipe: get EPIPE errors
	// instead of being killed by SIGPIPE halfway through the shutdown.
	signal.Ignore(syscall.SIGPIPE)
	sigCh := make(chan os.Signal, 2)
	signal.Notify(sigCh, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		s := <-sigCh
		stop("received " + s.String())
		<-sigCh
		logf("second signal, exiting immediately")
		os.Exit(1)
	}()
	if watchStdin {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			stop("stdin closed")
		}()
	}

	// Credentials.
	_, svcNet, _ := net.ParseCIDR(serviceCIDR)
	svcIP := make(net.IP, len(svcNet.IP))
	copy(svcIP, svcNet.IP)
	svcIP[len(svcIP)-1]++ // first address of the range: the "kubernetes" service
	p, err := loadOrGeneratePKI(filepath.Join(dataDir, "pki"), svcIP)
	if err != nil {
		logf("generating certificates: %v", err)
		return 1
	}

	// etcd.
	etcd, etcdURL, err := startEtcd(filepath.Join(dataDir, "etcd"), etcdLog, etcdLogLevel)
	if err != nil {
		logf("%v", err)
		return 1
	}
	stopEtcd := func() {
		etcd.Close()
	}
	logf("etcd ready at %s (%.1fs)", etcdURL, time.Since(start).Seconds())
	if ctx.Err() != nil {
		stopEtcd()
		return 0
	}

	// kube-apiserver on a pre-bound loopback listener.
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		logf("binding the secure port: %v", err)
		stopEtcd()
		return 1
	}
	serverURL := "https://" + ln.Addr().String()
	args := append(apiServerArgs(p, etcdURL, serviceCIDR), extraAPIServerArgs...)
	apiDone, err := startAPIServer(ctx, ln, args, apiLog)
	if err != nil {
		logf("%v", err)
		ln.Close()
		stopEtcd()
		if !verbose {
			printTail(apiLogPath, 40)
		}
		return 1
	}

	if err := writeKubeconfig(kubeconfigPath, serverURL, p); err != nil {
		logf("writing kubeconfig: %v", err)
		cancel()
		waitAPIServer(apiDone)
		stopEtcd()
		return 1
	}

	if err := waitReady(ctx, serverURL, p, apiDone); err != nil {
		if ctx.Err() != nil { // asked to stop while starting
			waitAPIServer(apiDone)
			stopEtcd()
			return 0
		}
		logf("kube-apiserver did not become ready: %v", err)
		if !verbose {
			printTail(apiLogPath, 40)
		}
		cancel()
		waitAPIServer(apiDone)
		stopEtcd()
		return 1
	}

	logf("kube-apiserver ready at %s after %.1fs (logs: %s)", serverURL, time.Since(start).Seconds(), logDir)
	fmt.Fprintf(readyOut, "READY %s\n", kubeconfigPath)
	_ = readyOut.Sync()

	select {
	case <-ctx.Done():
		waitAPIServer(apiDone)
		stopEtcd()
		logf("stopped")
		return 0
	case err := <-apiDone:
		logf("kube-apiserver exited unexpectedly: %v", err)
		stopEtcd()
		return 1
	}
}

// redirectStdoutToStderr returns a private handle on the original stdout and
// makes fd 1 a copy of fd 2.
func redirectStdoutToStderr() *os.File {
	fd, err := unix.Dup(1)
	if err != nil {
		return os.Stdout
	}
	unix.CloseOnExec(fd)
	if err := unix.Dup2(2, 1); err != nil {
		unix.Close(fd)
		return os.Stdout
	}
	return os.NewFile(uintptr(fd), "/dev/stdout")
}

func waitAPIServer(done <-chan error) {
	if err := <-done; err != nil {
		logf("kube-apiserver: %v", err)
	}
}

// waitReady polls /readyz with the admin credential until it answers ok and
// the "default" namespace exists.
func waitReady(ctx context.Context, serverURL string, p *pki, apiDone <-chan error) error {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(p.caPEM) {
		return errors.New("bad CA certificate")
	}
	transport := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"}}
	defer transport.CloseIdleConnections()
	client := &http.Client{Transport: transport, Timeout: 5 * time.Second}

	get := func(path string) (int, string) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, serverURL+path, nil)
		req.Header.Set("Authorization", "Bearer "+p.AdminToken)
		resp, err := client.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		return resp.StatusCode, string(body)
	}

	deadline := time.NewTimer(readyTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	last := ""
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-apiDone:
			return fmt.Errorf("kube-apiserver exited: %v", err)
		case <-deadline.C:
			return fmt.Errorf("timed out after %s; last answer: %s", readyTimeout, last)
		case <-tick.C:
		}
		code, body := get("/readyz")
		if code != http.StatusOK {
			last = fmt.Sprintf("/readyz %d %s", code, strings.TrimSpace(body))
			continue
		}
		if code, body = get("/api/v1/namespaces/default"); code != http.StatusOK {
			last = fmt.Sprintf("namespace default: %d %s", code, strings.TrimSpace(body))
			continue
		}
		return nil
	}
}

func printTail(path string, n int) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	if len(lines) == 0 {
		return
	}
	fmt.Fprintf(os.Stderr, "---- last %d lines of %s ----\n", len(lines), path)
	for _, l := range lines {
		fmt.Fprintln(os.Stderr, l)
	}
}
