package main

import (
	"context"
	"fmt"
	"io"
	"net"

	"github.com/spf13/pflag"

	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/apiserver/pkg/server/flagz"
	"k8s.io/client-go/rest"
	basecompatibility "k8s.io/component-base/compatibility"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
	"k8s.io/kubernetes/cmd/kube-apiserver/app/options"
)

// apiServerArgs are the kube-apiserver command-line flags for a loopback-only
// test control plane. The secure port itself is not a flag: a listener that is
// already bound to 127.0.0.1 is handed to the server.
func apiServerArgs(p *pki, etcdURL string, serviceCIDR string) []string {
	return []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--tls-cert-file=" + p.ServingCertFile,
		"--tls-private-key-file=" + p.ServingKeyFile,
		// Authentication: admin bearer token and client certs signed by our CA.
		"--token-auth-file=" + p.TokenFile,
		"--client-ca-file=" + p.CAFile,
		"--anonymous-auth=true", // /readyz, /healthz, /livez, /version stay public, as upstream
		"--authorization-mode=Node,RBAC",
		// Service accounts: the apiserver issues and verifies tokens itself.
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + p.SAPubFile,
		"--service-account-signing-key-file=" + p.SAKeyFile,
		// Only an allocation range for ClusterIPs; no traffic is ever routed.
		"--service-cluster-ip-range=" + serviceCIDR,
		// Do not publish the loopback address as the endpoint of the
		// "kubernetes" service: there is no cluster network.
		"--endpoint-reconciler-type=none",
		"--allow-privileged=true",
		"--profiling=false",
		"--v=0",
	}
}

// startAPIServer configures kube-apiserver the same way its own command does
// (options -> completed options -> config -> server chain), serves on ln, and
// runs it until ctx is cancelled. The returned channel receives the result of
// Run once the server has shut down.
func startAPIServer(ctx context.Context, ln net.Listener, args []string, logOut io.Writer) (<-chan error, error) {
	s := options.NewServerRunOptions()

	fs := pflag.NewFlagSet("kube-apiserver", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	namedFlagSets := s.Flags()
	for _, f := range namedFlagSets.FlagSets {
		fs.AddFlagSet(f)
	}
	s.Flagz = flagz.NamedFlagSetsReader{FlagSets: namedFlagSets}
	if err := fs.Parse(args); err != nil {
		return nil, fmt.Errorf("kube-apiserver flags: %w", err)
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected kube-apiserver arguments: %q", fs.Args())
	}

	s.SecureServing.Listener = ln
	s.SecureServing.BindPort = ln.Addr().(*net.TCPAddr).Port

	if err := s.GenericServerRunOptions.ComponentGlobalsRegistry.Set(); err != nil {
		return nil, err
	}
	// kube-apiserver's loopback clients should not log self-issued warnings.
	rest.SetDefaultWarningHandler(rest.NoWarnings{})

	featureGate := s.GenericServerRunOptions.ComponentGlobalsRegistry.FeatureGateFor(basecompatibility.DefaultKubeComponent)
	if err := logsapi.ValidateAndApplyWithOptions(s.Logs,
		&logsapi.LoggingOptions{ErrorStream: logOut, InfoStream: logOut}, featureGate); err != nil {
		return nil, fmt.Errorf("configuring kube-apiserver logging: %w", err)
	}

	completed, err := s.Complete(ctx)
	if err != nil {
		return nil, fmt.Errorf("completing kube-apiserver options: %w", err)
	}
	if errs := completed.Validate(); len(errs) != 0 {
		return nil, fmt.Errorf("invalid kube-apiserver options: %w", utilerrors.NewAggregate(errs))
	}

	config, err := app.NewConfig(completed)
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver config: %w", err)
	}
	completedConfig, err := config.Complete()
	if err != nil {
		return nil, fmt.Errorf("completing kube-apiserver config: %w", err)
	}
	server, err := app.CreateServerChain(completedConfig)
	if err != nil {
		return nil, fmt.Errorf("creating kube-apiserver server chain: %w", err)
	}
	prepared, err := server.PrepareRun()
	if err != nil {
		return nil, fmt.Errorf("preparing kube-apiserver: %w", err)
	}

	done := make(chan error, 1)
	go func() {
		done <- prepared.Run(ctx)
	}()
	return done, nil
}
